"""The RL training loop: pull a rollout from Redis, train, publish the new weight version.

Loop (rank 0 talks to Redis and the broker; every rank computes):
  pull     read groups until `rollout_batch_size` fit to train are in hand (`rollout.py`: a bad
           entry is dead-lettered, a group older than `max_staleness` versions dropped).
  train    per optimizer step: advantages -> micro-batches -> forward-only recompute of the
           trainer's log-probs -> forward+backward with the RL loss -> optimizer step.
  publish  version V += 1; HF-named weights to the broker (`ZmqWeightSender`), then
           `set_version("trainer", V)`, so a reader of the version can fetch it.
  commit   the counter `groups_consumed` grows by the rollout's groups (drops are counted
           when dropped); the groups leave the stream (ack) only now, and with --save only once
           a checkpoint holds their update: a crash before leaves them pending, and the next
           start trains them; see `checkpoint.py` for the exact contract. A step whose update
           was skipped records its groups as `skipped_update` drops, never as trained.
  log      metrics to Redis (`train/*`) and one line to stdout.
Start-up: the run contract is agreed in Redis before the model loads (a mismatch is exit 2),
and so is the lineage: a start without a checkpoint on a run that already has trained versions
is refused (exit 2) unless --new-lineage. A resumed version v > 0 is sent to the broker before
the first pull, so the engines serve v (the router's demand gate waits for that). Status
(`status.py`) says what the loop waits for.
Ends with an error (exit 1) after `max_skipped_in_a_row` skipped updates in a row, or when every
update of the run was skipped: exit code 0 means the weights were trained as asked.
Waits for: Redis (blocking reads of at most `read_block_ms`, so SIGTERM is seen within it; a
lost connection for at most --redis-timeout-s, `redis_wait.py`, then exit 1).
Bounded by: the router's `--max-buffer-depth` (producers wait), the sender's HWM and timeout.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from services.sample_buffer import BufferConfig, SampleBuffer
from services.sample_buffer.membership import Membership
from services.trainer import batching, checkpoint, losses, routing_replay
from services.trainer.batching import MicroBatch, TrainSample
from services.trainer.config import TrainerConfig, lineage_start
from services.trainer.intake import limits_of
from services.trainer.lease import end_on_lost, trainer_membership
from services.trainer.lineage import begin_lineage, rewind_ledger
from services.trainer.observe import TrainerObserver
from services.trainer.policy import Policy, init_distributed
from services.trainer.redis_wait import patient_client
from services.trainer.rollout import Intake, Rollout
from services.trainer.stats import StepStats, comm_device
from services.trainer.status import StatusReporter
from services.weight_sync import make_sender
from services.weight_sync.process_group import destroy_all
from services.weight_sync.wire import WeightSyncError

RESEND = "resend"  # broadcast by rank 0 instead of a rollout: every rank re-sends the version

log = logging.getLogger("tandem.trainer")


class SkippedUpdatesError(FloatingPointError):
    """Updates were skipped (non-finite loss or gradient norm) beyond what the run allows."""


class Trainer:
    """One process of the trainer; `train()` runs until max_steps or a stop signal."""

    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        torch.set_num_threads(cfg.model.num_threads)
        init_distributed(
            cfg.model.tensor_model_parallel_size, cfg.run.seed, cfg.model.expert_model_parallel_size
        )
        cfg.validate(parallel_state.get_data_parallel_world_size())
        self.is_main = dist.get_rank() == 0
        # A bad --load, or --no-resume over another run's checkpoint, fails before anything else.
        resume_root, found_by = checkpoint.find_resume(cfg)
        self.buffer: SampleBuffer | None = None
        self.intake: Intake | None = None
        self.status: StatusReporter | None = None
        self.sender = None
        self.stop_requested = False  # SIGTERM/SIGINT: finish the step, save, leave
        start_version = 0
        self.lease: Membership | None = None
        if self.is_main:
            start_version = self._join_run(resume_root)
        self.observe = TrainerObserver(cfg, self.buffer)  # /metrics, timeline, step lines
        self.policy = Policy(cfg, cfg.run.model)
        self.policy.on_phase = self.observe.mark
        self.ref = Policy(cfg, cfg.loss.ref_load, train=False) if cfg.loss.ref_load else None
        self.critic = None
        if cfg.loss.advantage_estimator == "gae":
            from services.trainer.critic import Critic

            self.critic = Critic(cfg, cfg.run.model)
        loss_fields = set(losses.PolicyLossConfig.__dataclass_fields__)
        self.loss_cfg = losses.PolicyLossConfig(**cfg.loss.model_dump(include=loss_fields))
        self.version = broadcast_int(start_version)
        self.skipped_updates = 0
        self.resent = 0  # the last version re-sent on the broker's request
        self.skipped_in_a_row: list[int] = []  # steps whose update was skipped, latest streak
        critic_model = self.critic.model if self.critic is not None else None
        self.checkpointer = checkpoint.Checkpointer(cfg, self.policy, critic_model)
        # Trained or dropped, waiting for a checkpoint (only with --save); rank 0's is the
        # intake's list (it adds stale drops), so that a checkpoint names them too.
        self.unacked: list[str] = self.intake.unacked if self.intake is not None else []
        if resume_root is not None:
            self._resume(resume_root, found_by, self.version)
        if self.is_main and cfg.weights.weights_endpoint:
            self.sender = make_sender(
                cfg.run.weight_transport,
                cfg.weights.weights_endpoint,
                shm_dir=cfg.weights.weights_shm_dir,
                master_address=cfg.weights.weights_master_address,
            )
        if self.buffer is not None:
            self.buffer.set_version("trainer", self.version)
        if self.lease is not None:  # (rewound by a resume above; only this trainer moves them)
            self.lease.watch("groups_consumed", "groups_trained")

    def _join_run(self, resume_root: Path | None) -> int:
        """Rank 0: the run's lease and contract, the lineage this start continues (the version
        it starts at), the status, the patient buffer and the intake."""
        cfg = self.cfg
        # Start-up checks fail fast on this client; the loop's waits out a lost connection.
        plain = SampleBuffer(BufferConfig(redis_url=cfg.run.redis_url, run_id=cfg.run.run_id))
        plain.wait_ready(timeout_s=10.0)
        member = self.lease = trainer_membership(plain)  # one per run: before any write
        member.join(lambda _holder: end_on_lost(member), cfg.run.contract())
        start_version = lineage_start(cfg, plain, resume_root is not None)
        if start_version and resume_root:  # back to an older checkpoint: the run as of
            checkpoint.rewind_to_newest(plain, resume_root, cfg.run.run_id)  # the newest first
        if start_version:
            weights = f"iteration {cfg.checkpoint.ckpt_step}" if resume_root else "--model"
            begin_lineage(plain, start_version, weights)
        self.status = StatusReporter(member)
        self.status.update("loading the model", model=cfg.run.model)
        client = patient_client(
            cfg.run.redis_url,
            cfg.batch.redis_timeout_s,
            cfg.batch.read_block_ms,
            lambda: self.stop_requested,
        )
        self.buffer = SampleBuffer(plain.config, client)
        self.lease.fence(self.buffer)
        limits = limits_of(cfg.run.model, cfg.batch.max_tokens_per_gpu, cfg.batch.max_response_len)
        self.intake = Intake(cfg, self.buffer, limits, self._report)
        self.intake.lineage_floor = start_version
        return start_version

    def _resume(self, root: Path, found_by: str, new_lineage: int) -> None:
        """From the checkpoint under `root`; with `new_lineage` (a version: --new-lineage from
        a checkpoint older than its folder's newest) its weights go on as that version (the
        ledger was rewound to the newest checkpoint at start: `checkpoint.rewind_to_newest`)."""
        if self.is_main and found_by != "--load":
            print(f"[trainer] resuming from {root} {found_by}", flush=True)
        resumed = self.checkpointer.load(root)
        self.version = new_lineage or resumed.version
        if new_lineage:
            return
        if self.intake is not None:
            self.intake.already_trained = set(resumed.trained_entry_ids)
            # Engines may serve a version this checkpoint precedes (published before a crash):
            # their groups are of this lineage, not from the future.
            self.intake.published_before = self.buffer.get_version("trainer") if self.buffer else 0
        if self.buffer is not None and resumed.groups_consumed is not None:
            lost = rewind_ledger(self.buffer, resumed, self.version)
            if lost and self.is_main:
                print(f"[trainer] {lost}", flush=True)
        if self.is_main:
            print(f"[trainer] resumed from iteration {self.version} ({root})", flush=True)

    def request_stop(self, signum: int = 0, frame: object = None) -> None:
        """Signal handler: finish the current step, then leave `train()`."""
        self.stop_requested = True

    def close(self, error: str = "") -> None:
        """Release the weight sender and leave the process group, so that no communicator
        or socket thread is still running when the interpreter exits (that aborts it)."""
        # (the status stays fresh until the end: this can take a minute, the watchdog says why)
        self._report("stopping", "its weight sender and process groups to close (<= 45 s)")
        self.observe.close()
        if self.sender is not None:
            # Stopped by a signal (tandem up stops every service at once): no engine is left
            # to take the last version, so its shared-memory slot is not held for them.
            self.sender.close(linger_s=0.0 if self.stop_requested else 15.0)
            self.sender = None
        if dist.is_initialized() and not destroy_all():
            print("[trainer] its process groups' teardown did not end in 30 s: left", flush=True)
        if self.status is not None:
            self.status.close("failed" if error else "stopped", error)
            self.status = None
        if self.lease is not None and (problem := self.lease.release()):
            print(f"[trainer] {problem}", flush=True)

    def install_signal_handlers(self) -> None:  # (SIGHUP: a trainer run in a closed terminal)
        for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(number, self.request_stop)

    # --- the loop -----------------------------------------------------------------------------

    def train(self) -> int:
        """Run until `max_steps` optimizer steps are done or a stop is requested; returns steps."""
        start_version = self.version
        if self.version > 0 and self.cfg.weights.weights_endpoint:  # engines start from --model
            # a broker that asked for this version before (it started while this trainer loaded
            # its checkpoint) has it with this send: not sent twice
            asked = self.buffer.get_version("resend") if self.buffer is not None else -1
            self.publish_weights(increment=False)
            if asked == self.version:
                self.resent = self.version
        while not self._done():
            waiting_since = time.time()
            rollout = self.pull_rollout()
            self.observe.waited(waiting_since, self.version)
            if rollout is None:  # stop requested while waiting for samples
                break
            samples = self.prepare_samples(rollout)
            skipped: set[int] = set()  # groups (indices) with a sample in a skipped step
            for step_samples in self.split_steps(samples, rollout):
                self._report("training", "", step=self.version + 1)
                before = self.skipped_updates
                metrics = self.train_step(step_samples)
                self.observe.mark("optimizer")
                if self.skipped_updates > before:
                    skipped |= {s.group for s in step_samples}
                params, nbytes = self.publish_weights()
                self.observe.mark("publish")
                metrics["train/weight_bytes"] = float(nbytes)
                metrics["train/params"] = float(params)
                self.observe.step_done(self.version, metrics, rollout)  # record, line, spans
            self.unacked += rollout.entry_ids
            self.record_rollout(rollout, skipped)
            self.commit(final=False)
        self.commit(final=True)
        steps = self.version - start_version
        if steps and self.skipped_updates == steps:
            raise SkippedUpdatesError(
                f"every update of this run was skipped ({steps} steps): the loss or gradient "
                f"norm was not finite (NaN/Inf) at each; {SKIP_ADVICE}"
            )
        return steps

    def record_rollout(self, rollout: Rollout, skipped: set[int]) -> None:
        """Count the rollout's groups consumed; the lineage of these weights (`trained`) names
        the groups trained, those of a skipped update are recorded as drops instead. With no
        checkpoint to wait for (no --save), the entries done are acked in the same script."""
        if self.intake is None or self.buffer is None:
            return
        self.intake.drop_skipped([rollout.groups[i] for i in sorted(skipped)], self.version)
        trained = [g.group_id for i, g in enumerate(rollout.groups) if i not in skipped]
        ack = [] if self.checkpointer.enabled else self.intake.finished()
        self.buffer.record_trained(self.version, trained, len(rollout.groups), ack)

    def _report(self, state: str, waiting_for: str = "", **detail: float | int | str) -> None:
        if self.status is not None:
            self.status.update(state, waiting_for, version=self.version, **detail)

    def _done(self) -> bool:
        stop = torch.tensor([float(self.stop_requested)], device=comm_device())
        if dist.get_world_size() > 1:  # every rank leaves together
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        steps_done = self.cfg.batch.max_steps and self.version >= self.cfg.batch.max_steps
        return bool(stop.item()) or bool(steps_done)

    # --- pull ---------------------------------------------------------------------------------

    def pull_rollout(self) -> Rollout | None:
        """Rank 0 reads from Redis; every rank receives the same Rollout (or None on stop)."""
        rollout = None
        if self.intake is not None:
            rollout = self.intake.read_rollout(self.version, self._between_reads)
        if dist.get_world_size() > 1:
            box: list[Rollout | str | None] = [rollout]
            dist.broadcast_object_list(box, src=0)
            while box[0] == RESEND:  # rank 0 re-sends the version while it waits: join it
                self.publish_weights(increment=False)
                dist.broadcast_object_list(box, src=0)
            rollout = box[0] if isinstance(box[0], Rollout) else None
        return rollout

    def prepare_samples(self, rollout: Rollout) -> list[TrainSample]:
        """Advantages per group, then one TrainSample per sample (in group order)."""
        adv = batching.compute_advantages(
            rollout.groups,
            self.cfg.loss.advantage_estimator,
            self.cfg.loss.normalize_advantage_std,
            self.cfg.loss.advantage_eps,
            self.cfg.loss.gamma,
        )
        for g in rollout.groups:
            for s in g.samples:
                age = self.version - s.weight_version
                rollout.staleness_counts[age] = rollout.staleness_counts.get(age, 0) + 1
        return batching.flatten(rollout.groups, adv)

    def split_steps(self, samples: list[TrainSample], rollout: Rollout) -> list[list[TrainSample]]:
        """`num_steps_per_rollout` consecutive chunks of the rollout's samples."""
        n = self.cfg.run.num_steps_per_rollout
        size = math.ceil(len(samples) / n) or 1
        return [samples[i : i + size] for i in range(0, len(samples), size)]

    # --- train --------------------------------------------------------------------------------

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """Recompute, train, step; returns the step's metrics (reduced over ranks)."""
        from services.trainer import step_math

        dp_rank = parallel_state.get_data_parallel_rank()
        dp_size = parallel_state.get_data_parallel_world_size()
        if len(samples) < dp_size:  # a rank without samples would hang the gradient all-reduce
            raise batching.BatchError(
                f"step {self.version + 1} has {len(samples)} samples for {dp_size} data-parallel "
                "ranks: raise --rollout-batch-size or lower --num-steps-per-rollout"
            )
        mine = samples[dp_rank::dp_size]
        stats = StepStats()
        mbs = batching.make_micro_batches(
            mine,
            self.cfg.batch.use_dynamic_batch_size,
            self.cfg.batch.max_tokens_per_gpu,
            self.cfg.batch.micro_batch_size,
        )
        if self.cfg.model.expert_model_parallel_size > 1:
            mbs = self._equalize(mbs)
        if self.policy.replays:  # a micro-batch without the engine's routing uses its own
            missing = routing_replay.attach(mbs, mine, self.policy.arch)
            stats.add("routing_replay", len(mbs) - missing, len(mbs))
        recomputed = self._recompute(mbs, mine, stats)
        self.observe.mark("recompute")
        if self.critic is not None:
            self.critic.fill_advantages(mbs, mine, stats)
        loss_fn = step_math.LossFunction(
            self.cfg,
            self.loss_cfg,
            max((len(s.advantages) for s in samples), default=1),  # the longest response
            stats,
            samples=None if recomputed else mine,
            version=self.version,
        )
        _, applied, grad_norm = self.policy.train_step(
            mbs,
            loss_fn,
            with_entropy=self.cfg.loss.entropy_coef != 0 or not recomputed,
            entropy_grad=self.cfg.loss.entropy_coef != 0,
        )
        self._note_update(applied, grad_norm)
        if self.critic is not None:
            self.critic.train(mbs, stats)
        step_math.batch_stats(mbs, mine, self.cfg.batch.max_tokens_per_gpu, stats)
        stats.reduce(parallel_state.get_data_parallel_group())  # TP ranks hold the same samples
        metrics = step_math.metrics_from(
            stats, samples, self.version, self.cfg.loss.advantage_estimator
        )
        metrics["train/grad_norm"] = grad_norm
        metrics["train/skipped_updates"] = float(self.skipped_updates)  # (in this process)
        metrics["train/update_skipped"] = float(not applied)  # this step's: none trained
        metrics["train/lr"] = float(self.policy.optimizer.param_groups[0]["lr"])
        return metrics

    def _note_update(self, applied: bool, grad_norm: float) -> None:
        """Count a skipped update; fail at the first (--on-nonfinite fail) or at a streak."""
        if applied:
            self.skipped_in_a_row = []
            return
        step = self.version + 1
        self.skipped_updates += 1
        self.skipped_in_a_row.append(step)
        if self.cfg.loss.on_nonfinite == "fail":
            raise FloatingPointError(f"non-finite gradient at step {step} (grad norm {grad_norm})")
        limit = self.cfg.loss.max_skipped_in_a_row
        if self.is_main:
            print(f"[trainer] step {step}: update skipped (grad norm {grad_norm})", flush=True)
        if limit and len(self.skipped_in_a_row) >= limit:
            steps = ", ".join(map(str, self.skipped_in_a_row))
            raise SkippedUpdatesError(
                f"the updates of steps {steps} were skipped, {limit} in a row "
                f"(--max-skipped-in-a-row {limit}): the loss or gradient norm was not finite "
                f"(NaN/Inf; last grad norm {grad_norm}); {SKIP_ADVICE}"
            )

    @staticmethod
    def _equalize(mbs: list[MicroBatch]) -> list[MicroBatch]:
        """The same number of micro-batches of the same length on every data-parallel rank
        (expert-parallel groups lie within them): see `batching.equalize`."""
        shape = torch.tensor(
            [len(mbs), max(mb.input_ids.shape[1] for mb in mbs)], device=comm_device()
        )
        dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
        return batching.equalize(mbs, int(shape[0]), int(shape[1]))

    def _recompute(
        self, mbs: list[MicroBatch], samples: list[TrainSample], stats: StepStats
    ) -> bool:
        """Reference log-probs, and where needed (`recompute_logprobs`) the trainer's log-probs
        before the update with the mismatch metrics; returns whether those were recomputed."""
        from services.trainer import step_math

        penalty = self.ref is not None and not self.cfg.loss.use_kl_loss
        recompute = self.cfg.loss.recompute_logprobs == "always" or penalty
        if recompute:
            outs = self.policy.logprobs(mbs, with_entropy=True)
            for mb, out in zip(mbs, outs, strict=True):
                mb.proximal_logp, mb.entropy = out["logp"].cpu(), out["entropy"].cpu()
        if self.ref is not None:
            for mb, out in zip(mbs, self.ref.logprobs(mbs), strict=True):
                mb.ref_logp = out["logp"].cpu()
            if penalty:
                step_math.apply_kl_reward_penalty(
                    mbs, self.cfg.loss.kl_coef, self.cfg.loss.kl_loss_type
                )
        if recompute:
            step_math.mismatch_stats(mbs, samples, self.version, stats)
        return recompute

    # --- publish, ack, log --------------------------------------------------------------------

    def _between_reads(self) -> bool:
        """Each time a wait for samples wakes: send the current version again when the broker
        asks (`version:resend`: it restarted after taking a version it never delivered);
        True to stop waiting. The export is collective: at TP/DP > 1 rank 0 first tells the
        other ranks, which wait in `pull_rollout`'s broadcast."""
        assert self.buffer is not None
        asked = self.buffer.get_version("resend")
        if asked == self.version > self.resent:
            self.resent = self.version
            print(f"[trainer] the broker asks for version {asked} again: re-sending", flush=True)
            if dist.get_world_size() > 1:
                dist.broadcast_object_list([RESEND], src=0)
            self.publish_weights(increment=False)
        return self.stop_requested

    def publish_weights(self, increment: bool = True) -> tuple[int, int]:
        """V += 1 (unless re-sending a resumed V); send V's HF-named weights; then announce V in
        Redis. Returns the (parameters, bytes) of the exported model."""
        self.version += int(increment)
        self._report("publishing", f"the weight broker to take version {self.version}")
        # Collective at TP > 1: every rank takes part. The NCCL sender broadcasts from the GPU
        # before the next optimizer step, so the tensors need not be copied to the host.
        on_device = self.cfg.run.weight_transport == "nccl"
        tensors = self.policy.export_hf(on_device=on_device)
        params = sum(t.numel() for _, t in tensors)
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        if self.sender is not None:
            try:
                self.sender.send(self.version, tensors)
            except WeightSyncError as exc:  # engines keep the previous version; training goes on
                log.warning("version %d did not reach the engines: %s", self.version, exc)
        if self.buffer is not None:
            self.buffer.set_version("trainer", self.version)
        return params, nbytes

    def commit(self, final: bool) -> None:
        """Ack trained groups (`unacked`) left unacked; with --save only once a checkpoint
        holds their update. --save-hf: a HF directory at each checkpoint and at the end."""
        if self.checkpointer.enabled and not self.checkpointer.due(self.version, final):
            return
        save = self.cfg.checkpoint.save if self.checkpointer.enabled else ""
        with checkpoint.saving(
            self.version, {"--save": save, "--save-hf": self.cfg.checkpoint.save_hf}
        ):
            if self.checkpointer.enabled:
                self._report("saving a checkpoint", step=self.version)
                counters = self.buffer.counters() if self.buffer is not None else {}
                self.checkpointer.save(
                    self.version,
                    self.intake.checkpoint_keys() if self.intake is not None else self.unacked,
                    counters.get("groups_consumed", 0),
                    counters.get("groups_dead_lettered", 0),
                )
            if self.cfg.checkpoint.save_hf and (final or self.checkpointer.enabled):
                self.write_hf()
        if self.intake is not None:
            self.intake.ack_done()
        self.unacked.clear()

    def write_hf(self) -> None:
        """--save-hf: this version as a complete HF directory (collective at TP > 1)."""
        from services.trainer.convert import write_hf_dir

        self._report("writing the Hugging Face model", step=self.version)
        tensors = self.policy.export_hf()
        if self.is_main:
            out = write_hf_dir(
                dict(tensors),
                self.policy.hf_config_json,
                self.cfg.checkpoint.save_hf,
                self.cfg.run.model,
            )
            print(
                f"[trainer] wrote the Hugging Face model of version {self.version} to {out}",
                flush=True,
            )


SKIP_ADVICE = (
    "check --lr (too high?), the rewards and log-probs of the samples (NaN?), or pass "
    "--on-nonfinite fail to stop at the first"
)


def broadcast_int(value: int) -> int:
    """Rank 0's `value` on every rank."""
    if dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])
