"""Weight updates: from the weight broker (ZMQ), from disk, and by torch.distributed broadcast.

Every path has the same two phases:
1. receive the new tensors into fresh memory (a worker thread; generation keeps running) and
   check every name and shape against the model; anything wrong refuses the whole update and
   the model is untouched;
2. apply: a draining scheduler command (no sequence runs, none starts, arrivals wait), copies
   the tensors in (or makes them the parameters' storage: shared-memory slots, broadcasts),
   sets `weight_version` and drops any cache built with the old weights.
Both phases are bounded by `update_timeout_s`; a timeout answers an error, never a hang.

Distributed path: the engine joins a process group named by the request at
`rank_offset` (the trainer is rank 0) through a TCP rendezvous on `master_address:master_port`,
with keys under the group name, as SGLang does. The backend follows the device (gloo on CPU,
NCCL on CUDA); the receiving code is the same for both. The group's timeout (its collectives')
is 0.75x `update_timeout_s`, or `timeout_s` of the request if shorter (Tandem's extension,
advertised as `"weight_update_group_timeout": true`: the broker sends the trainer's).

`POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name",
"flush_cache", "weight_version", "load_format", "bucket_sizes"}`:
- no `load_format` (or null), as every SGLang version: one `broadcast(src=0)` per listed tensor,
  in the listed order, each into a tensor of its dtype and shape.
- `"load_format": "flattened_bucket"` (SGLang's bucketed format): ONE broadcast of a 1-D
  `torch.uint8` tensor holding the bytes of every listed tensor, concatenated in listed order
  with no padding (tensor by tensor, `t.reshape(-1).view(torch.uint8)`).
- `"bucket_sizes": [n0, n1, ...]` (Tandem's extension, flattened_bucket only; advertised as
  `"weight_update_bucket_sizes": true` in `/get_server_info`): tensor counts of consecutive
  buckets, summing to `len(names)`. One flat broadcast per bucket, in order; then the whole
  request (a whole version) is checked and applied once. A sum that does not match is 400.
- `"layout_id": "..."` (Tandem's extension, advertised as `"weight_update_layout_id": true`):
  names the request's layout (names, dtypes, shapes, bucket_sizes). The engine keeps the last
  few it parsed and checked; a later request may send the `layout_id` without `names`,
  `dtypes`, `shapes` and `bucket_sizes`, which saves parsing and checking thousands of names
  per version. An id the engine does not know is a 409 before any collective: send the full
  request again.
Every broadcast of a request is posted at once; the engine lays the tensors out over the
receive buffers and plans the load while the bytes arrive, so only the apply follows them.
Received tensors live in fresh memory: views of each bucket's flat buffer where a tensor's byte
offset is a multiple of its element size, copies otherwise. At apply, a tensor that is a
parameter of the model on the same device and dtype becomes that parameter's storage (no
copy); the rest (a tied name such as `lm_head.weight` of a tied model, another dtype or device)
is copied in. Memory: until the apply, the engine holds the received tensors beside its
current weights, i.e. up to one extra copy of the model for a whole version. For whole
versions of a layout sent by `layout_id`, the engine keeps two sets of receive buffers, with
their tensor views and load plan made once, and receives each version into the set that is
not the model's storage: no allocation and no per-tensor work per version. That is the same
memory the allocator would keep cached for the previous version's buffers anyway.
`--no-whole-version-updates` stops advertising `bucket_sizes` (and refuses it): the broker then
sends one request per bucket, each applied on arrival, bounding the extra memory to a bucket.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from proto import sglang as sg
from services.common.hf_weights import weight_files
from services.engine.model_runner import LoadPlan, ModelRunner, WeightError
from services.engine.scheduler import Scheduler
from services.engine.weight_layout import (
    NamedTensors,
    PreparedLayout,
    ReceiveSet,
    UpdateError,
    flat_views,
    torch_dtype,
)
from services.weight_sync.process_group import join_group, leave_group, wait_all

log = logging.getLogger(__name__)

LAYOUTS_KEPT = 4  # layouts remembered by `layout_id` (one per model layout a trainer sends)
# The weight group's timeout and its broadcasts' wait, of --update-timeout-s: a broken broadcast
# is answered as such (500, the group dropped) before the update's own bound (504).
COLLECTIVE_SHARE = 0.75


class WeightUpdater:
    """Runs the receive-check-apply sequence for each update path; one update at a time."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        timeout_s: float,
        whole_version: bool = True,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.timeout_s = timeout_s
        self.group_timeout = timedelta(seconds=timeout_s * COLLECTIVE_SHARE)
        self._timeout = self.group_timeout  # the group's: the broker may send a shorter one
        self.whole_version = whole_version  # accept `bucket_sizes` (see the module docstring)
        self._lock = asyncio.Lock()
        # Shared-memory slot our parameters live in after a zero-copy update (see _apply).
        self._lease: Any = None
        self._group: Any = None
        self._group_name = ""
        self._layouts: dict[str, PreparedLayout] = {}  # by layout_id, oldest first
        self._live: ReceiveSet | None = None  # the receive set the parameters are views of
        # one dedicated thread: receives (ZMQ, disk, broadcast) never queue behind other work
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-weights")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _in_thread(self, fn: Callable[[], Any], what: str) -> Any:
        def bound() -> Any:
            self.runner.bind_thread()
            return fn()

        future = asyncio.get_running_loop().run_in_executor(self._pool, bound)
        # not wait_for: a TimeoutError raised by `fn` itself (naming its own limit) must reach
        # the caller as it is, not be mistaken for this bound
        done, _ = await asyncio.wait({future}, timeout=self.timeout_s)
        if not done:
            future.cancel()
            raise UpdateError(
                f"{what} took longer than {self.timeout_s:g}s (--update-timeout-s)", 504
            )
        return future.result()

    def _check_forward(self, version: int | None) -> None:
        """409 for a version below the one served: versions only go forward. An engine restarted
        from its load weights serves version 0 and takes any."""
        served = self.scheduler.weight_version
        if version is not None and version < served:
            raise UpdateError(
                f"weight_version {version} is older than version {served} this engine serves; "
                "weights unchanged (versions only go forward)",
                409,
            )

    async def _apply(
        self,
        tensors: NamedTensors,
        version: int | None,
        abort_all: bool,
        lease: Any = None,
        adopt: bool = False,
        plan: LoadPlan | None = None,
        live: ReceiveSet | None = None,
    ) -> int:
        """Check, then copy in while the scheduler is drained; returns the new version.
        `abort_all` ends running requests (partial output) instead of waiting for them.

        With a `lease` (a shared-memory slot from the broker's one-host path) and a version
        that covers every parameter on CPU, the slot's copy-on-write views become the
        parameters' storage: no copy. The lease is kept while they live there and the
        previous one released, which frees its slot for the trainer's next-but-one version.
        With `adopt` (tensors in memory of their own, e.g. received by broadcast), each tensor
        matching its parameter's device and dtype becomes its storage; the others are copied.
        A `plan` (from `ModelRunner.plan_load`, made while the data arrived) means `tensors`
        were checked already and the apply only carries it out. `live`: the receive set
        `tensors` lie in, kept as the model's storage (None: memory of their own)."""
        if plan is None:
            try:
                self.runner.check_weights((n, t.shape) for n, t in tensors)
            except WeightError as exc:
                raise UpdateError(f"weights refused, model unchanged: {exc}", 400) from exc
        if abort_all:
            self.scheduler.abort(None, "Abort due to weight update")

        def apply() -> int:
            return self._load(tensors, version, lease, adopt, plan, live)

        future = self.scheduler.run_exclusive(apply, drain=True)
        try:
            return await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(future)), self.timeout_s
            )
        except TimeoutError as exc:
            if self.scheduler.cancel(future):
                raise UpdateError(
                    f"running requests did not finish within {self.timeout_s:.0f}s; weights "
                    "unchanged (pause_generation first, or raise --update-timeout-s)",
                    504,
                ) from exc
            return await asyncio.wrap_future(future)  # already copying: a short wait

    def _load(
        self,
        tensors: NamedTensors,
        version: int | None,
        lease: Any,
        adopt: bool,
        plan: LoadPlan | None,
        live: ReceiveSet | None,
    ) -> int:
        """On the scheduler's thread, drained: the weights copied in (or adopted), the caches
        cleared, the version set; the lease of the slot they now live in kept, and the receive
        set they are views of (`live`)."""
        started = time.monotonic()
        if plan is not None:
            count = self.runner.apply_load(plan)
            adopted = False
        else:
            adopted = lease is not None and self.runner.can_adopt(tensors)
            count = self.runner.load_weights(tensors, adopt=adopted or adopt)
        self.scheduler.clear_caches()  # nothing may be served from the old weights' keys
        previous, self._lease = self._lease, (lease if adopted else None)
        self._live = live
        if previous is not None:
            previous.release()
        if version is not None:
            self.scheduler.weight_version = version
        log.info(
            "weights: %d tensors loaded in %.3fs, now version %s",
            count,
            time.monotonic() - started,
            self.scheduler.weight_version,
        )
        return self.scheduler.weight_version

    # ---- the three sources --------------------------------------------------------------------

    async def from_zmq(
        self, endpoint: str, version: int, timeout_s: float | None = None, abort_all: bool = False
    ) -> int:
        """Fetch `version` from the weight broker at `endpoint` and apply it."""
        import zmq

        from services.weight_sync.wire import AuthenticationError, secret_from_env
        from services.weight_sync.zmq_transport import BrokerGoneError, fetch_weights

        if timeout_s is not None and timeout_s < self.timeout_s:
            wait_s, which = timeout_s, "the request's timeout_s"
        else:
            wait_s, which = self.timeout_s, "--update-timeout-s"
        async with self._lock:
            self._check_forward(version)
            try:
                tensors = await self._in_thread(
                    lambda: fetch_weights(endpoint, version, secret_from_env(), wait_s),
                    f"fetching weights from {endpoint}",
                )
            except (LookupError, AuthenticationError, ValueError, zmq.ZMQError) as exc:
                raise UpdateError(f"weight broker at {endpoint}: {exc}", 400) from exc
            except BrokerGoneError as exc:
                raise UpdateError(str(exc), 502) from exc
            except TimeoutError as exc:
                raise UpdateError(
                    f"weight broker at {endpoint} sent nothing within {wait_s:g}s ({which})", 504
                ) from exc
            return await self._apply(tensors, version, abort_all, lease=tensors.lease)

    async def from_disk(self, model_path: str, version: int | None, abort_all: bool = False) -> int:
        """Reload every tensor found in an HF directory's safetensors (or .bin) files."""
        async with self._lock:
            self._check_forward(version)
            try:
                tensors = await self._in_thread(
                    lambda: read_checkpoint(model_path), "reading weights"
                )
            except (OSError, ValueError, RuntimeError) as exc:
                raise UpdateError(f"could not load weights from {model_path}: {exc}", 400) from exc
            return await self._apply(tensors, version, abort_all)

    async def init_group(self, body: sg.InitWeightsUpdateGroupReqInput) -> None:
        """Join the trainer's weight-update group (blocks until every rank joined)."""
        backend = "nccl" if self.runner.device.type == "cuda" else "gloo"
        asked = body.backend or backend
        if asked != backend:
            raise UpdateError(
                f"the weight group uses backend {asked!r} but this engine runs on "
                f"{self.runner.device.type} ({backend}): put the engines on GPUs for NCCL "
                "(--device cuda), or the trainer on CPU, or use the zmq weight transport",
                400,
            )
        async with self._lock:
            try:
                await self._in_thread(
                    lambda: self._join(body, backend), "joining the process group"
                )
            except UpdateError:
                raise
            except TimeoutError as exc:  # nobody hosts the rendezvous: bounded, then 504
                raise UpdateError(f"{exc} ({self._join_bound(body)})", 504) from exc
            except (RuntimeError, ValueError, OSError) as exc:  # e.g. a store that refused us
                raise UpdateError(f"could not join the weight update group: {exc}", 400) from exc

    async def destroy_group(self) -> None:
        async with self._lock:
            if self._group is None:
                raise UpdateError("no weight update group to destroy", 400)
            group, self._group = self._group, None
            await self._in_thread(lambda: leave_group(group), "leaving the group")

    def _join_bound(self, body: sg.InitWeightsUpdateGroupReqInput) -> str:
        """What bounded the join just timed out, as the 504 says it."""
        waited = f"waited {self._timeout.total_seconds():g}s"
        if body.timeout_s and body.timeout_s < self.group_timeout.total_seconds():
            return f"{waited}: the request's timeout_s"
        return f"{waited}: {COLLECTIVE_SHARE:g} of --update-timeout-s {self.timeout_s:g}"

    def _join(self, body: sg.InitWeightsUpdateGroupReqInput, backend: str) -> None:
        if self._group is not None:
            leave_group(self._group)
            self._group = None
        given = timedelta(seconds=body.timeout_s or self.group_timeout.total_seconds())
        self._timeout = min(given, self.group_timeout)
        address, port, name = body.master_address, body.master_port, body.group_name
        self._group = join_group(
            address, port, body.rank_offset, body.world_size, name, backend, self._timeout
        )
        self._group_name = name

    async def from_distributed(self, body: sg.UpdateWeightsFromDistributedReqInput) -> int:
        """Receive a version by broadcast from rank 0 (per tensor, or flat buckets; see the
        module docstring), then apply it all at once."""
        prepared = self._prepared_layout(body)
        if self._group is None:
            raise UpdateError("no weight update group: call /init_weights_update_group first", 400)
        # (a body that names no group means the one joined)
        group_name = body.group_name if "group_name" in body.model_fields_set else self._group_name
        if group_name != self._group_name:
            raise UpdateError(
                f"group_name {group_name!r} is not the joined group {self._group_name!r}", 400
            )
        async with self._lock:
            try:
                started = time.monotonic()
                tensors, plan, received = await self._in_thread(
                    functools.partial(self._receive, prepared), "receiving broadcast weights"
                )
                log.info(
                    "weights: received %d tensors by broadcast in %.3fs",
                    len(tensors),
                    time.monotonic() - started,
                )
            except UpdateError:
                raise
            except RuntimeError as exc:  # e.g. a peer left mid-collective
                raise UpdateError(f"broadcast failed, weights unchanged: {exc}", 500) from exc
            if prepared.problem:  # refused only now: leaving the collective early hangs it
                raise UpdateError(f"weights refused, model unchanged: {prepared.problem}", 400)
            self._check_forward(body.weight_version)
            return await self._apply(
                tensors,
                body.weight_version,
                body.abort_all_requests,
                adopt=True,
                plan=plan,
                live=received,
            )

    def _prepared_layout(self, body: sg.UpdateWeightsFromDistributedReqInput) -> PreparedLayout:
        """The request's layout, parsed and checked against the model; from the cache when
        the body names a known `layout_id` instead of listing the tensors."""
        layout_id = body.layout_id
        flat = body.load_format is not None
        if body.names is None or body.dtypes is None or body.shapes is None:
            prepared = self._layouts.get(layout_id) if layout_id is not None else None
            if prepared is None:
                raise UpdateError(
                    f"layout_id {layout_id!r} is unknown to this engine (it keeps the last "
                    f"{LAYOUTS_KEPT}): send names, dtypes and shapes with it",
                    409,
                )
            if (prepared.bucket_sizes is not None) != flat:
                raise UpdateError(
                    f"layout_id {layout_id!r} was sent with another load_format: send names, "
                    "dtypes and shapes again",
                    409,
                )
            return prepared
        names, dtypes, shapes = body.names, body.dtypes, body.shapes
        if not (len(names) == len(dtypes) == len(shapes)):
            raise UpdateError("names, dtypes and shapes must have the same length", 400)
        bucket_sizes = self._flat_bucket_sizes(body.load_format, body.bucket_sizes, len(names))
        layout = [
            (n, torch_dtype(d), list(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)
        ]
        try:
            self.runner.check_weights((n, s) for n, _, s in layout)
            problem = ""
        except WeightError as exc:
            problem = str(exc)
        prepared = PreparedLayout(layout, bucket_sizes, problem)
        if layout_id is not None:
            self._layouts.pop(layout_id, None)
            for older in self._layouts.values():  # receive sets for the newest layout only
                older.keep, older.receive_sets = False, []
            prepared.keep = bucket_sizes is not None and body.bucket_sizes is not None
            self._layouts[layout_id] = prepared
            while len(self._layouts) > LAYOUTS_KEPT:
                self._layouts.pop(next(iter(self._layouts)))
        return prepared

    def _flat_bucket_sizes(
        self, load_format: str | None, sizes: list[int] | None, count: int
    ) -> list[int] | None:
        """Tensor counts of the flat buckets to receive; None = one broadcast per tensor."""
        if load_format is None:
            if sizes is not None:
                raise UpdateError('bucket_sizes needs "load_format": "flattened_bucket"', 400)
            return None
        if load_format != "flattened_bucket":
            raise UpdateError(
                f'load_format {load_format!r} is not supported: use "flattened_bucket" or '
                "leave it out (one broadcast per tensor)",
                400,
            )
        if sizes is None:
            return [count] if count else []
        if not self.whole_version:
            raise UpdateError(
                "bucket_sizes is off on this engine (--no-whole-version-updates): send one "
                "request per bucket",
                400,
            )
        if sum(sizes) != count:
            raise UpdateError(
                f"bucket_sizes must sum to the number of names ({count}), not {sum(sizes)}", 400
            )
        return list(sizes)

    def _receive(self, prepared: PreparedLayout) -> tuple[NamedTensors, LoadPlan, Any]:
        """Post every broadcast at once (async), lay the tensors out over the receive buffers
        and plan the load while the bytes arrive (or take a kept receive set, where all of
        that is done), then wait for them. Returns the tensors, the load plan and the receive
        set used. Everything is received even when a name is wrong: leaving the collective
        early would hang it."""
        device, group = self.runner.device, self._group
        if prepared.bucket_sizes is None:
            out = [(n, torch.empty(s, dtype=d, device=device)) for n, d, s in prepared.layout]
            works = [torch.distributed.broadcast(t, 0, group, async_op=True) for _, t in out]
            plan = None if prepared.problem else self.runner.plan_load(out, adopt=True)
            self._wait(works)
            return out, plan or LoadPlan(), None
        if prepared.keep:
            received = prepared.receive_set(self._live, lambda: self._receive_set(prepared))
            works = [
                torch.distributed.broadcast(f, 0, group, async_op=True) for f in received.flats
            ]
        else:
            flats = [torch.empty(n, dtype=torch.uint8, device=device) for n in prepared.nbytes]
            works = [torch.distributed.broadcast(f, 0, group, async_op=True) for f in flats]
            received = self._receive_set(prepared, flats)
        out, plan = received.out, received.plan
        if received.misaligned:  # copies need the bytes: made once they are here
            self._wait(works, synchronize=False)
            out = list(out)
            for i in received.misaligned:
                (name, raw), (_, dtype, shape) = out[i], prepared.layout[i]
                out[i] = (name, raw.clone().view(dtype).view(shape))
            if plan is not None:
                extra = self.runner.plan_load([out[i] for i in received.misaligned], adopt=True)
                plan = LoadPlan(plan.adopt + extra.adopt, plan.copy + extra.copy)
        self._wait(works)
        return out, plan or LoadPlan(), received if prepared.keep else None

    def _receive_set(
        self, prepared: PreparedLayout, flats: list[torch.Tensor] | None = None
    ) -> ReceiveSet:
        """Receive buffers (new unless given) with the layout's tensors over them, planned."""
        if flats is None:
            flats = [
                torch.empty(n, dtype=torch.uint8, device=self.runner.device)
                for n in prepared.nbytes
            ]
        out: NamedTensors = []
        misaligned: list[int] = []
        for flat, bucket in zip(flats, prepared.buckets(), strict=True):
            first = len(out)
            misaligned.extend(first + i for i in flat_views(flat, bucket, out))
        skip = set(misaligned)
        aligned = [x for i, x in enumerate(out) if i not in skip]
        plan = None if prepared.problem else self.runner.plan_load(aligned, adopt=True)
        return ReceiveSet(flats, out, misaligned, plan)

    def _wait(self, works: list[Any], synchronize: bool = True) -> None:
        """Wait for the broadcasts (a dead peer raises, on NCCL too); a failed one leaves the
        group unusable: dropped as failed (process_group.py); the broker forms a fresh one."""
        try:
            wait_all(works, self._timeout)
        except Exception:
            group, self._group = self._group, None
            if group is not None:
                leave_group(group, failed=True)
            raise
        if synchronize:
            self._synchronize()

    def _synchronize(self) -> None:
        # The tensors are adopted as parameters by the generation thread: make sure the
        # collectives (NCCL's own stream) and the misaligned copies have finished first.
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)


def read_checkpoint(model_path: str) -> NamedTensors:
    """Every tensor of an HF directory's weight files (`weight_files`), by HF name."""
    path = Path(model_path)
    if not path.is_dir():
        raise ValueError(f"{model_path} is not a directory")
    from safetensors.torch import load_file

    tensors: NamedTensors = []
    for file in weight_files(path):
        if file.suffix == ".safetensors":
            tensors.extend(load_file(str(file)).items())
        else:
            tensors.extend(torch.load(file, map_location="cpu", weights_only=True).items())
    if not tensors:
        raise ValueError(f"no *.safetensors or *.bin weight files in {model_path}")
    return tensors
