"""The engine behind the HTTP routes: model runner + scheduler + weight updates, as async calls.

Each public coroutine is what one route does. Generation work happens on the scheduler's
generation thread; this class only parses, submits, and waits for the scheduler's callbacks
(delivered into the event loop with `call_soon_threadsafe`). Blocking work that is not
generation (fetching weights over ZMQ, reading a checkpoint, joining a process group) runs in a
worker thread so the event loop keeps answering `/health` meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from services.engine import api
from services.engine.config import BatchSection, EngineConfig, check
from services.engine.metrics import EngineMetrics
from services.engine.model_runner import ModelRunner
from services.engine.sampling import RequestError
from services.engine.scheduler import Job, Scheduler
from services.engine.weights import WeightUpdater

log = logging.getLogger(__name__)
DEFAULT_KV_CACHE_GB = BatchSection().kv_cache_gb


def kv_budget(kv_cache_gb: float, device: Any) -> float:
    """The KV budget in GiB: `kv_cache_gb` when `device` has that much free beside the loaded
    weights (or 0 = unbounded). A budget given beyond it is refused (RuntimeError naming the
    flag: sequences admitted up to it would outgrow the memory under load, not at the start);
    the default is lowered to 90% of what is free, with a warning."""
    import psutil
    import torch

    if not kv_cache_gb:
        return 0.0
    cuda = device.type == "cuda"
    free = torch.cuda.mem_get_info(device)[0] if cuda else psutil.virtual_memory().available
    if kv_cache_gb * 2**30 <= free:
        return kv_cache_gb
    said = f"--kv-cache-gb {kv_cache_gb:g} is more than the {free / 2**30:.1f} GiB free on {device}"
    if kv_cache_gb != DEFAULT_KV_CACHE_GB:
        raise RuntimeError(
            f"{said} beside the model's weights: sequences admitted up to it would not fit; "
            "lower --kv-cache-gb (tandem up takes it as it is)"
        )
    log.warning(
        "%s (the default): the engine keeps %.1f GiB for keys/values", said, free * 0.9 / 2**30
    )
    return free * 0.9 / 2**30


class Engine:
    """Owns the model, the scheduler and the weight updater for one server."""

    def __init__(self, config: EngineConfig) -> None:
        import torch

        config.validate()
        if problems := check(config):
            raise ValueError(problems[0])
        torch.set_num_threads(config.batch.num_threads)
        self.config = config
        self.runner = ModelRunner(
            config.served.model,
            config.served.tokenizer,
            config.served.device,
            config.served.dtype,
            config.served.load_format,
        )
        context = config.served.context_length or self.runner.max_position
        self.context_length = min(context, self.runner.max_position)
        budget = kv_budget(config.batch.kv_cache_gb, self.runner.device)
        self.max_total_tokens = int(budget * 2**30 / self.runner.kv_bytes_per_token)
        if budget and self.max_total_tokens < self.context_length:  # (as SGLang does)
            said = f"--kv-cache-gb {budget:g} holds {self.max_total_tokens} tokens of this model"
            if self.max_total_tokens < 2:  # (0 tokens was taken for unbounded)
                raise RuntimeError(f"{said}: nothing fits; give more (0 = unbounded)")
            log.warning("%s: the context is lowered to it from %d", said, self.context_length)
            self.context_length = self.max_total_tokens
        self.scheduler = Scheduler(
            self.runner,
            config.batch.max_batch_size,
            config.batch.max_prefill_tokens,
            config.batch.max_queued_requests,
            self.context_length,
            config.weights.weight_version,
            self.max_total_tokens,
            config.batch.prompt_cache_tokens,
        )
        self.weights = WeightUpdater(
            self.runner,
            self.scheduler,
            config.weights.update_timeout_s,
            config.weights.whole_version_updates,
        )
        self.released = False  # weights moved off the device by /release_memory_occupation
        self.metrics = EngineMetrics()

    def start(self) -> None:
        self.scheduler.start()
        log.info(
            "serving %s on %s (%s), context %d, weight version %s",
            self.config.served.model,
            self.runner.device,
            str(self.runner.dtype).removeprefix("torch."),
            self.context_length,
            self.weight_version,
        )

    def shut_down_requests(self) -> None:
        """The server is stopping: end every request, queued or running or held by a pause,
        with an abort finish reason saying so (their clients get their partial output).
        Aborts apply while paused, so a paused engine needs no resume for this."""
        self.scheduler.abort(None, "server shutting down (SIGTERM)")

    def stop(self) -> None:
        self.weights.close()
        self.scheduler.stop()

    @property
    def weight_version(self) -> int:
        return self.scheduler.weight_version

    # ---- generation ---------------------------------------------------------------------------

    def parse(self, body: Any) -> api.GenerateInput:
        tok = self.runner.tokenizer
        return api.parse_generate(body, tok, self.runner.vocab_size, self.context_length)

    async def generate(self, inp: api.GenerateInput) -> Any:
        """Run a parsed request to completion; the SGLang-shaped response body."""
        loop = asyncio.get_running_loop()
        finished = loop.create_future()
        pending = [len(inp.prompts)]

        def on_job_done() -> None:
            pending[0] -= 1
            if pending[0] == 0 and not finished.done():
                finished.set_result(None)

        def notify(_job: Job, done: bool) -> None:
            if done:
                loop.call_soon_threadsafe(on_job_done)

        jobs = api.make_jobs(inp, notify)
        started = time.monotonic()
        self.scheduler.submit(jobs)
        try:
            await finished
        except asyncio.CancelledError:  # client went away: stop spending compute on it
            for job in jobs:
                self.scheduler.abort(job.rid, "client disconnected")
            raise
        self.metrics.request_done(time.monotonic() - started)
        return api.response_json(jobs, inp, self.runner.tokenizer)

    async def stream(self, inp: api.GenerateInput) -> AsyncIterator[Any]:
        """Cumulative snapshots of each sequence as it grows; the last one has finish_reason.
        Several sequences (batch or n > 1) are told apart by `index`."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def notify(_job: Job, _done: bool) -> None:
            loop.call_soon_threadsafe(wake.set)

        jobs = api.make_jobs(inp, notify)
        seqs = [s for job in jobs for s in job.sequences]
        sent = [-1] * len(seqs)  # tokens in the last chunk sent for each sequence
        finished = [False] * len(seqs)
        started = time.monotonic()
        self.scheduler.submit(jobs)
        try:
            while not all(finished):
                await wake.wait()
                wake.clear()
                for index, seq in enumerate(seqs):
                    done = seq.done  # read before the tokens: a final chunk is complete
                    if finished[index] or (len(seq.logprobs) == sent[index] and not done):
                        continue
                    chunk = api.sequence_json(seq, inp, self.runner.tokenizer, done)
                    if len(seqs) > 1:
                        chunk["index"] = index
                    sent[index], finished[index] = chunk["meta_info"]["completion_tokens"], done
                    yield chunk
        finally:
            if not all(finished):  # the client went away mid-stream
                for job in jobs:
                    self.scheduler.abort(job.rid, "client disconnected")
        self.metrics.request_done(time.monotonic() - started)

    async def health_generate(self, timeout_s: float = 20.0) -> bool:
        """Generate one token end to end (what SGLang's /health_generate does)."""
        inp = self.parse(
            {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        )
        try:
            await asyncio.wait_for(self.generate(inp), timeout_s)
        except (TimeoutError, RequestError):
            return False
        return True

    # ---- control ------------------------------------------------------------------------------

    async def pause(self, mode: str) -> None:
        """`mode`: abort, retract or in_place (the route's body type allows no other)."""
        await asyncio.wrap_future(self.scheduler.pause(mode))

    def resume(self) -> None:
        if self.released:
            raise RequestError("memory is released: call /resume_memory_occupation first")
        self.scheduler.resume()

    async def release_memory(self) -> None:
        """Colocated mode: stop generating and move the weights off the accelerator (kept in
        host memory, so resuming restores them). SGLang requires an idle server; so do we."""
        if not self.scheduler.idle:
            raise RequestError("requests are running: pause_generation (abort) or wait first")
        await asyncio.wrap_future(self.scheduler.pause("in_place"))

        def offload() -> None:
            self.scheduler.clear_caches()
            self.runner.model.to("cpu")

        await asyncio.wrap_future(self.scheduler.run_exclusive(offload))
        self.released = True

    async def resume_memory(self) -> None:
        if not self.released:
            raise RequestError("memory is not released")
        device = self.runner.device
        await asyncio.wrap_future(
            self.scheduler.run_exclusive(lambda: self.runner.model.to(device))
        )
        self.released = False
        self.resume()

    def abort(self, rid: str | None) -> None:
        self.scheduler.abort(rid)

    async def flush_cache(self) -> bool:
        """Forget cached prompts; as SGLang, only when idle. Returns whether it flushed."""
        if not self.scheduler.idle:
            return False
        await asyncio.wrap_future(
            self.scheduler.run_exclusive(self.scheduler.clear_caches, drain=False)
        )
        return True

    def weights_by_name(self, name: str, truncate_size: int) -> list:
        """The first `truncate_size` rows of parameter `name` (SGLang's /get_weights_by_name;
        the route's body type holds `truncate_size` >= 1)."""
        params = self.runner.model.state_dict()
        if name not in params:
            raise RequestError(f"name {name!r} is not a parameter of the model")
        return params[name][:truncate_size].float().cpu().tolist()

    # ---- info ---------------------------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.config.served.model,
            "tokenizer_path": self.config.served.tokenizer or self.config.served.model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(self.weight_version),
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(self.runner.config, "model_type", None),
            "architectures": getattr(self.runner.config, "architectures", None),
        }

    def server_info(self) -> dict[str, Any]:
        info = {
            "model_path": self.config.served.model,
            "tokenizer_path": self.config.served.tokenizer or self.config.served.model,
            "served_model_name": self.served_model_name,
            "context_length": self.context_length,
            "device": self.config.served.device,
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "max_running_requests": self.config.batch.max_batch_size,
            "max_total_num_tokens": self.max_total_tokens,
            "tp_size": 1,
            "dp_size": 1,
            "weight_version": str(self.weight_version),
            "version": "tandem-reference-engine",
            # Tandem's extension of /update_weights_from_distributed (see engine/weights.py)
            "weight_update_bucket_sizes": self.config.weights.whole_version_updates,
            "weight_update_layout_id": True,
            "weight_update_group_timeout": True,  # of /init_weights_update_group
        }
        info["internal_states"] = [{**self.scheduler.load(), **self.scheduler.stats}]
        return info

    @property
    def served_model_name(self) -> str:
        return self.config.served.served_model_name or self.config.served.model
