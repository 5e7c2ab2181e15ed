"""Router overhead: one bounded loopback load, direct to workers, through Tandem's router and
through the Rust `sglang-router`, measured in one run.

Workers are `bench/instant_worker.py` (SGLang's answer shape, at once), so what is measured is the routing: requests/s, p50/p99 latency and the latency each
router adds over going direct, at concurrency 1 and 64, and each router's CPU-seconds per 1,000
requests (user + system time of its process, from psutil). `tandem` forwards with its own keep-alive
HTTP/1.1 client (`--hot-path-client http1`, the default), `tandem-aio` with aiohttp; a last
section runs the same direct load with each candidate client (http1, aiohttp, httpx) as the
load generator. Those two measurements are why the default is what it is.

    python bench/router_overhead.py [--requests 3000] [--repeats 3] [--skip-rust]

Targets: added p50 <= 1 ms at concurrency 1; router CPU per request within 2x of the Rust
router. The machine's other processes share the cores, so repeat runs vary by some 10-20%.
The last line is `name: value` (Tandem's CPU per request over the Rust router's).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.instant_worker import InstantWorkerProcess  # noqa: E402
from services.common.serving import bind_socket  # noqa: E402
from services.rollout_router.balancer.http1 import Http1Pool  # noqa: E402
from services.sample_buffer import RedisServer  # noqa: E402

BODY = json.dumps(
    {
        "input_ids": [1, 5, 6, 14],
        "return_logprob": True,
        "sampling_params": {"n": 1, "max_new_tokens": 4, "temperature": 1.0},
    }
).encode()
HEADERS = {"Content-Type": "application/json"}


async def aiohttp_load(urls: list[str], n: int, concurrency: int) -> tuple[list[float], float]:
    """`n` POST /generate over `concurrency` loops, URLs taken in turn; (latencies s, wall s)."""
    latencies: list[float] = []
    counter = itertools.count()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def loop() -> None:
            while (i := next(counter)) < n:
                start = time.perf_counter()
                async with session.post(urls[i % len(urls)], data=BODY, headers=HEADERS) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{urls[i % len(urls)]}: HTTP {r.status}")
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return latencies, time.perf_counter() - start


async def http1_load(urls: list[str], n: int, concurrency: int) -> tuple[list[float], float]:
    latencies: list[float] = []
    counter = itertools.count()
    pool = Http1Pool(timeout_s=60)
    split = [u.rsplit("/", 1) for u in urls]

    async def loop() -> None:
        while (i := next(counter)) < n:
            base, path = split[i % len(split)]
            start = time.perf_counter()
            status, _body = await pool.post(base, "/" + path, BODY)
            if status != 200:
                raise RuntimeError(f"{urls[i % len(urls)]}: HTTP {status}")
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    pool.close()
    return latencies, time.perf_counter() - start


async def httpx_load(urls: list[str], n: int, concurrency: int) -> tuple[list[float], float]:
    latencies: list[float] = []
    counter = itertools.count()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:

        async def loop() -> None:
            while (i := next(counter)) < n:
                start = time.perf_counter()
                r = await client.post(urls[i % len(urls)], content=BODY, headers=HEADERS)
                r.raise_for_status()
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return latencies, time.perf_counter() - start


def cpu_s(pid: int | None) -> float:
    if pid is None:
        return 0.0
    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    return sum(p.cpu_times().user + p.cpu_times().system for p in procs)


def measure(
    urls: list[str], n: int, concurrency: int, pid: int | None, client: str = "aiohttp"
) -> dict:
    load = {"aiohttp": aiohttp_load, "httpx": httpx_load, "http1": http1_load}[client]
    asyncio.run(load(urls, min(200, n), concurrency))  # warm connections and caches
    cpu0 = cpu_s(pid)
    latencies, wall = asyncio.run(load(urls, n, concurrency))
    cpu = cpu_s(pid) - cpu0
    q = statistics.quantiles(latencies, n=100)
    return {
        "rps": n / wall,
        "p50_ms": q[49] * 1e3,
        "p99_ms": q[98] * 1e3,
        "cpu_s_per_1k": cpu / n * 1000,
    }


def wait_http(url: str, timeout_s: float = 60.0) -> None:
    """Until POST `url` answers 200; the error names the last answer (status and body)."""
    deadline = time.monotonic() + timeout_s
    last = "no connection"
    while time.monotonic() < deadline:
        try:
            req = urllib.request.Request(url, data=BODY, headers=HEADERS)
            with urllib.request.urlopen(req, timeout=2) as resp:
                if resp.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}: {exc.read()[:300]!r}"
        except OSError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 in {timeout_s:.0f} s (last: {last})")


def start_tandem(
    workdir: Path, urls: list[str], redis_url: str, client: str
) -> tuple[subprocess.Popen, str]:
    ready = workdir / f"router-{client}.json"
    cmd = [
        sys.executable,
        "-m",
        "tandem.cli",
        "router",
        "--no-rollout",
        "--engine-urls",
        *urls,
        "--redis-url",
        redis_url,
        "--port",
        "0",
        "--ready-file",
        str(ready),
        "--log-level",
        "WARNING",
        "--hot-path-client",
        client,
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("tandem router did not start")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())["url"]


def start_rust(urls: list[str]) -> tuple[subprocess.Popen, str]:
    ports = []
    for _ in range(2):
        sock = bind_socket("127.0.0.1", 0)
        ports.append(sock.getsockname()[1])
        sock.close()
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *urls,
        "--policy",
        "round_robin",
        "--host",
        "127.0.0.1",
        "--port",
        str(ports[0]),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(ports[1]),
        "--log-level",
        "error",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    url = f"http://127.0.0.1:{ports[0]}"
    wait_http(url + "/generate")
    return proc, url


def rollout_batches(workdir: Path, urls: list[str], redis_url: str, model: Path, n: int) -> None:
    """The router's own time per rollout batch (64 prompts x n=8, instant engines)."""
    from services.sample_buffer import BufferConfig, SampleBuffer

    ready = workdir / "rollout.json"
    cmd = [
        sys.executable,
        "-m",
        "tandem.cli",
        "router",
        "--engine-urls",
        *urls,
        "--model",
        str(model),
        "--redis-url",
        redis_url,
        "--run-id",
        "bench",
        "--max-staleness",
        "100000",
        "--max-buffer-depth",
        "100000",
        "--eval-interval",
        "0",
        "--port",
        "0",
        "--ready-file",
        str(ready),
        "--log-level",
        "WARNING",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, start_new_session=True)
    buffer = SampleBuffer(BufferConfig(redis_url=redis_url, run_id="bench"))
    times: list[float] = []
    marks: list[tuple[int, float]] = []  # (batches finished, router CPU s) at start and end
    try:
        deadline = time.monotonic() + 120
        while len(times) < n + 1 and time.monotonic() < deadline:
            records = buffer.read_metrics()
            times = [
                r.values["rollout/batch_time_s"]
                for _id, r in records
                if "rollout/batch_time_s" in r.values
            ]
            if (times and not marks) or len(times) >= n + 1:
                marks.append((len(times), cpu_s(proc.pid)))
            time.sleep(0.005)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    steady = times[1 : n + 1]  # batch 0 includes connection set-up
    (b0, c0), (b1, c1) = marks[0], marks[-1]
    per_batch_cpu = (c1 - c0) / max(b1 - b0, 1)  # batches still running add a little
    print(
        f"\nrollout batch (64 prompts x n=8, 2 instant engines, puts into Redis): "
        f"median {statistics.median(steady) * 1e3:.1f} ms wall, max {max(steady) * 1e3:.1f} ms; "
        f"router CPU {per_batch_cpu * 1e3:.1f} ms per batch"
    )


def report(results: dict[tuple[str, int], dict], concurrencies: list[int]) -> None:
    print(
        f"{'target':<11}{'conc':>5}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'+p50 ms':>9}{'+p99 ms':>9}{'cpu s/1k':>10}"
    )
    for (target, c), r in results.items():
        base = results[("direct", c)]
        added = (r["p50_ms"] - base["p50_ms"], r["p99_ms"] - base["p99_ms"])
        cpu = f"{r['cpu_s_per_1k']:.3f}" if target != "direct" else "-"
        print(
            f"{target:<11}{c:>5}{r['rps']:>10.0f}{r['p50_ms']:>9.3f}{r['p99_ms']:>9.3f}"
            f"{added[0]:>9.3f}{added[1]:>9.3f}{cpu:>10}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000, help="requests per measurement")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--skip-rust", action="store_true")
    parser.add_argument("--batches", type=int, default=10, help="rollout batches to time")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    args = parser.parse_args()
    concurrencies = [1, 64]
    with tempfile.TemporaryDirectory() as tmp, RedisServer(log_dir=Path(tmp)) as redis_server:
        workdir = Path(tmp)
        from tandem.toy_model import write_toy_model

        model = write_toy_model(workdir / "model")  # sglang-router wants a local model_path
        workers = [InstantWorkerProcess(workdir, f"w{i}", model) for i in range(args.workers)]
        procs: list[subprocess.Popen] = []
        try:
            urls = [w.url for w in workers]
            targets: dict[str, tuple[list[str], int | None]] = {
                "direct": ([u + "/generate" for u in urls], None)
            }
            for client, name in (("http1", "tandem"), ("aiohttp", "tandem-aio")):
                proc, url = start_tandem(workdir, urls, redis_server.url, client)
                procs.append(proc)
                targets[name] = ([url + "/generate"], proc.pid)
            if not args.skip_rust:
                rust, rust_url = start_rust(urls)
                procs.append(rust)
                targets["rust"] = ([rust_url + "/generate"], rust.pid)
            runs: dict[tuple[str, int], list[dict]] = {}
            for _repeat in range(args.repeats):  # interleaved, so drift hits every target alike
                for name, (target_urls, pid) in targets.items():
                    for c in concurrencies:
                        run = measure(target_urls, args.requests, c, pid)
                        runs.setdefault((name, c), []).append(run)
            results = {
                key: {field: statistics.median(r[field] for r in rs) for field in rs[0]}
                for key, rs in runs.items()
            }
            print(f"median of {args.repeats} interleaved runs of {args.requests} requests each")
            report(results, concurrencies)
            print("\nhot-path client, direct to workers, concurrency 64:")
            for client in ("http1", "aiohttp", "httpx"):
                r = measure(targets["direct"][0], args.requests, 64, None, client)
                print(f"  {client:<8} {r['rps']:>8.0f} req/s  p50 {r['p50_ms']:.3f} ms")
            rollout_batches(workdir, urls, redis_server.url, model, args.batches)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=10)
            for worker in workers:
                worker.stop()
    added_c1 = results[("tandem", 1)]["p50_ms"] - results[("direct", 1)]["p50_ms"]
    print(f"\ntandem added p50 at concurrency 1: {added_c1:.3f} ms (target <= 1 ms)")
    if args.skip_rust:
        print(f"tandem_added_p50_ms_c1: {added_c1:.3f}")
        return 0
    for c in concurrencies:
        t, r = results[("tandem", c)], results[("rust", c)]
        print(
            f"concurrency {c}: tandem/rust req/s {t['rps'] / r['rps']:.2f}, "
            f"cpu per request {t['cpu_s_per_1k'] / r['cpu_s_per_1k']:.2f}x"
        )
    t, r = results[("tandem", 64)], results[("rust", 64)]
    print(f"tandem_cpu_per_request_vs_rust_c64: {t['cpu_s_per_1k'] / r['cpu_s_per_1k']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
