"""UpRun: one `tandem up` run, from start-up to summary (see tandem/launcher.py)."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from redis.exceptions import RedisError

from proto import MetricsRecord
from services.common.engine_info import versions_or_why
from services.sample_buffer import BufferConfig, RedisServer, SampleBuffer
from tandem.patches import PatchCopy
from tandem.progress import RunProgress, metrics_rows
from tandem.run_dir import (
    WRITE_ERRORS,
    DiskWatch,
    default_run_dir,
    install_interrupt_handler,
    kept_configuration,
    lock_run_dir,
    restore_files,
    resume_command,
    share_run_secrets,
    write_summary,
    write_timeline,
)
from tandem.run_redis import REDIS_FILE, run_id_of
from tandem.sinks import MetricSinks, say
from tandem.supervisor import ChildFailedError, StartInterruptedError, Supervisor, die_with_parent
from tandem.up_args import (
    RUN_CONFIG,
    lost_history,
    optimizer_used,
    save_config,
    steps_saved,
    stopped_early,
    trainer_start,
)
from tandem.up_config import check_sample_fit, service_problems, state_trainer_limits
from tandem.up_engines import Restarts, wait_engines_synced
from tandem.up_launch import MODEL_DEFAULTS
from tandem.up_services import (
    TRAINED_MODEL,
    gpu_env,
    run_values,
    service_args,
    shared_gpus,
    trains_in_bf16,
)
from tandem.up_tree import UpTree, child_file, render, wired
from tandem.watchdog import Watchdog

# What stopping a run waits for (tandem up says it when Ctrl-C comes, and when it is slow).
STOPPING = " (the router first; the trainer saves its last checkpoint, within --stop-timeout-s)"

# Outcomes a resume would only repeat, and what to do instead (every other one goes on with one).
NO_RESUME = {
    "config_error": "fix the setting named above and start the run again (a resume repeats it)",
    "ledger_unbalanced": "its ledger does not balance (groups lost or counted twice): a resume "
    "would go on from it; start a new run on a Redis that keeps its keys",
}


class RedisUnreachableError(RuntimeError):
    """The run's Redis did not answer at start-up."""


class UpRun:
    def __init__(self, tree: UpTree) -> None:
        self.tree, self.config = tree, tree.up  # (the launch section: [up])
        config = tree.up
        self.max_steps = int(tree.value("trainer", "max_steps"))
        # absolute: the paths saved in it (the toy model's) hold wherever --resume runs
        self.run_dir = (
            Path(config.run_dir) if config.run_dir else default_run_dir(config.run.seed)
        ).absolute()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.lock = lock_run_dir(self.run_dir, resume=bool(config.resume))
        self.run_id = run_id_of(self.run_dir, bool(config.run.redis_url), new=not config.resume)
        self.redis: RedisServer | None = None
        self.interrupted: list[bool] = []
        self.supervisor = Supervisor(self.run_dir / "logs", self.interrupted, note=say)
        self.outcome = "running"
        self.replayed = 0  # a resume's steps trained after its checkpoint (trained again)
        self.health_urls: dict[str, str] = {}
        self.eval_task = ""
        self.ledger: dict | None = None  # written at exit (ledger.json)
        self.last_metrics_id = "0"  # the last record of the metrics stream read
        self.disk = DiskWatch(self.run_dir)
        self.token_at = ""  # where the API token is (share_run_secrets)
        # A resume's saved configuration, put back when it stops before its services are up
        # (refused, interrupted): the configuration of its last launch that ran stays the run's.
        self.kept = kept_configuration(self.run_dir) if config.resume else {}

    def run(self) -> int:
        install_interrupt_handler(self.interrupted)
        self.token_at = share_run_secrets(self.run_dir)
        started = time.monotonic()
        progress: RunProgress | None = None
        buffer: SampleBuffer | None = None
        sinks = MetricSinks(self.run_dir, self.config.wandb_project, self.tree.settings())
        try:
            buffer, urls = self.start_services()
            goal = self.config.by_model("stop_accuracy")
            why = f"stop at held-out accuracy >= {goal} or" if goal else "no accuracy goal; stop"
            say(
                f"all services up in {time.monotonic() - started:.1f}s; training "
                f"({why} at iteration {self.max_steps}, --max-steps)"
            )
            progress = RunProgress(self.run_dir, bool(self.config.resume), replayed=self.replayed)
            code = self.monitor(buffer, progress, sinks)
            engine_versions = versions_or_why(urls)  # proof the weights moved
        except ChildFailedError as exc:  # at start-up (a service that refused its configuration: 2)
            self.outcome = "config_error" if exc.code == 2 else "child_failed"
            code, engine_versions = 2 if exc.code == 2 else 1, []
            say(f"FAILED: {self.own_redis_gone() or exc}")
        except StartInterruptedError as exc:
            say(f"{exc}: stopping every service")
            self.outcome, code, engine_versions = "interrupted", 130, []
        except RedisUnreachableError as exc:
            say(f"FAILED: {exc}")
            self.outcome, code, engine_versions = "redis_unavailable", 1, []
        except OSError as exc:  # metrics.jsonl and the other files of the run folder
            if exc.errno not in WRITE_ERRORS:
                raise
            note = self.disk.note()
            say(f"FAILED: could not write {exc.filename or self.run_dir}: {exc.strerror}{note}")
            self.outcome, code, engine_versions = "run_dir_unwritable", 1, []
        finally:
            if note := self.disk.note():  # whatever stopped the run
                say(note.strip())
            self.stop_services()
            if buffer is not None and progress is not None:
                self.drain_metrics(buffer, progress, sinks)
            self.remove_weight_slots()
            with self.writing("metrics.jsonl and tensorboard/"):
                sinks.close()
            if buffer is not None:  # the services wrote their last spans when they stopped
                with self.writing("timeline.json", whole=True):
                    write_timeline(buffer, self.run_id, self.run_dir)
                with self.writing("ledger.json", whole=True):
                    self.write_ledger(buffer)
            if self.redis is not None:
                self.redis.stop()
                (self.run_dir / "redis.url").unlink(missing_ok=True)
            with self.writing("up_config.json and config.toml (as they were)"):
                if note := restore_files(self.kept):  # (none once the resume runs)
                    say(note)
        if progress is not None:
            with self.writing("metrics.jsonl"):
                progress.close()
            self.finish(progress, engine_versions, time.monotonic() - started)
        return 130 if self.interrupted else 1 if self.outcome == "ledger_unbalanced" else code

    # --- start-up -----------------------------------------------------------------------------

    def start_services(self) -> tuple[SampleBuffer, list[str]]:
        config, tree = self.config, self.tree
        for line in optimizer_used(tree, self.run_dir):  # (before the run folder records them)
            say(line)
        buffer, redis_url = self.start_redis()
        model = Path(config.run.model) if config.run.model else self.write_model()
        save_config(self.run_dir, tree, str(model))
        run = run_values(tree, self.run_id, model, redis_url, self.run_dir)
        # (checked before the start too, but for what needs the model, written now)
        if problems := service_problems(tree, run):
            raise ChildFailedError("\n".join(problems), code=2)
        recorded = (self.run_dir / RUN_CONFIG).resolve()
        recorded.write_text(render(tree, run))
        say(f"configuration of every service in {recorded} (repeat: tandem up --config it)")
        state_trainer_limits(buffer, tree, model)
        configs, _ = wired(tree, run)
        configs["trainer"], self.replayed = trainer_start(
            tree, configs["trainer"], self.run_dir, buffer
        )
        # Each service reads its section from its own file, then the addresses as flags.
        files = {name: child_file(configs, name, self.run_dir) for name in configs}
        args = service_args(files, run)
        if trains_in_bf16(tree):
            say("the trainer trains in bf16 on its GPU (fp32 master weights), as the engines serve")
        for gpu in shared_gpus(tree):
            say(
                f"GPU {gpu} is shared by the engines and the trainer: bound the engines' memory "
                "with --kv-cache-gb N (their KV cache; default 4) and keep the "
                "trainer's batch small (--max-tokens-per-gpu N)"
            )
        engines = [
            self.supervisor.start(
                f"engine{i}", args["engine"], env=gpu_env(config.engine_gpus[i : i + 1])
            )
            for i in range(config.num_engines)
        ]
        self.supervisor.wait_ready(engines, config.by_model("startup_timeout_s"))
        urls = [e.info["url"] for e in engines]
        say(f"engines at {' '.join(urls)}")
        broker = self.supervisor.start("broker", [*args["broker"], "--engine-urls", *urls])
        self.supervisor.wait_ready([broker], config.by_model("startup_timeout_s"))
        # The trainer loads while the router starts (it needs only Redis and the broker).
        self.start_trainer(args["trainer"], broker.info["intake_endpoint"])
        # The router hands engines added or restarted at run time to the broker.
        router = self.supervisor.start(
            "router", [*args["router"], "--engine-urls", *urls, "--broker-url", broker.info["url"]]
        )
        self.supervisor.wait_ready([router], config.by_model("startup_timeout_s"))
        self.health_urls = {"router": router.info["url"], "broker": broker.info["url"]}
        self.say_router_terms(router.info)
        check_sample_fit(router.info, tree, say)
        say(
            f"broker at {broker.info['url']} (weights in at {broker.info['intake_endpoint']}), "
            f"router at {router.info['url']} (dashboard: {router.info['url']}/; its writes and "
            f"the API's need the token in {self.token_at})"
        )
        say(f"logs in {self.supervisor.log_dir}")
        self.kept = {}  # (the resume runs: its configuration is the run's now)
        return buffer, urls

    def start_redis(self) -> tuple[SampleBuffer, str]:
        """The run's Redis (`--redis-url`, else one of its own, its data in the run folder)."""
        redis_url = self.config.run.redis_url
        if not redis_url:
            self.redis = RedisServer(
                log_dir=self.run_dir / "logs",
                data_dir=self.run_dir / "redis",  # the run's buffer outlives it: --resume
                preexec_fn=die_with_parent,
            )
            redis_url = self.redis.start().url
            say(f"redis at {redis_url} (pid {self.redis.process.pid})")  # type: ignore[union-attr]
            (self.run_dir / "redis.url").write_text(redis_url)  # `tandem ledger RUN` reads it
        buffer = SampleBuffer(BufferConfig(redis_url=redis_url, run_id=self.run_id))
        try:
            buffer.wait_ready(min(30.0, self.config.by_model("startup_timeout_s")))
        except ConnectionError as exc:  # its message names the URL and --redis-url
            raise RedisUnreachableError(str(exc)) from exc
        where = {"url": redis_url, "run_id": self.run_id, "own": self.redis is not None}
        (self.run_dir / REDIS_FILE).write_text(json.dumps(where))  # for tandem metrics/timeline
        if self.config.resume and (lost := lost_history(buffer.counters())):
            say(lost)
        return buffer, redis_url

    def say_router_terms(self, info: dict) -> None:
        """What the router chose that the user may not expect (its ready line's terms)."""
        config = self.config
        self.eval_task = str(info.get("eval_task", "?"))
        say(f"held-out accuracy scores {self.eval_task}")
        for note in info.get("task_notes", []):
            say(note)
        if ": none" in self.eval_task and (goal := config.by_model("stop_accuracy")):
            say(
                f"no held-out prompts: --stop-accuracy {goal} cannot be reached "
                "(give --eval-prompt-data, or --stop-accuracy 0 to train --max-steps)"
            )
        if note := self.model_defaults():
            say(note)
        length = info.get("rollout_max_response_len", "?")
        why = " (the router's default for this task and model: --rollout-max-response-len)"
        given = self.tree.given("router", "rollout_max_response_len")
        say(f"responses up to {length} tokens{'' if given else why}")

    def model_defaults(self) -> str:
        """What a new run with a --model took by default of what depends on the model ("" for
        the toy model, a resume, or none taken)."""
        up = self.config
        if not up.run.model or up.resume:
            return ""
        unset = {n: up.unset(n) for n in MODEL_DEFAULTS.keys() - {"lr"}}
        unset["lr"] = not self.tree.given("trainer", "lr")
        taken = [name for name in MODEL_DEFAULTS if unset[name]]
        if not taken:
            return ""
        value = {n: up.by_model(n) for n in unset.keys() - {"lr"}}
        value["lr"] = self.tree.value("trainer", "lr")
        whats = ", ".join(MODEL_DEFAULTS[n][2].format(value[n]) for n in taken)
        flags = ", ".join("--" + n.replace("_", "-") for n in taken)
        return f"{whats} (the defaults for a --model; {flags} set them)"

    def start_trainer(self, args: list[str], intake_endpoint: str) -> None:
        """Start the trainer (under torchrun with --trainer-procs > 1), not waited for here."""
        config = self.config
        trainer_args = [*args, "--weights-endpoint", intake_endpoint]
        program = None
        if config.trainer_procs > 1:  # torchrun: one process per rank, same flags
            program = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={config.trainer_procs}",
                "-m",
                "services.trainer",
            ]
            trainer_args = trainer_args[1:]  # no "trainer" subcommand word
        self.supervisor.start(
            "trainer", trainer_args, ready=False, env=gpu_env(config.trainer_gpus), program=program
        )

    def write_model(self) -> Path:
        from tandem.toy_model import write_toy_model

        seed = self.config.run.seed
        path = write_toy_model(self.run_dir / "model", seed=seed)
        say(f"toy model (seed {seed}) written to {path}")
        return path

    # --- watching -----------------------------------------------------------------------------

    def monitor(self, buffer: SampleBuffer, progress: RunProgress, sinks: MetricSinks) -> int:
        config = self.config
        limit_s = config.by_model("time_limit_s")
        deadline = time.monotonic() + limit_s if limit_s else math.inf
        # A resumed run's stream holds the earlier records: read on after the newest one
        # metrics.jsonl holds (not the stream's end: a record whose write failed, on a full
        # disk, is written now).
        rows = list(metrics_rows(self.run_dir)) if config.resume else []
        self.last_metrics_id = buffer.metrics_id_of(rows[-1] if rows else None)
        stall_fail_s, goal = config.by_model("stall_fail_s"), config.by_model("stop_accuracy")
        watchdog = Watchdog(
            buffer, self.health_urls, config.stall_warn_s, stall_fail_s, say, self.max_steps
        )
        restarts = self.restarts(watchdog)
        self.patches = PatchCopy(self.run_dir, buffer, say)  # (says what a resume re-applied)
        redis_lost_at = 0.0  # when Redis stopped answering (0: it answers)
        while True:
            asked = time.monotonic()
            try:
                records = buffer.read_metrics(after_id=self.last_metrics_id, block_ms=500)
            except RedisError as exc:
                first = not redis_lost_at
                redis_lost_at = redis_lost_at or asked
                lost_s = time.monotonic() - redis_lost_at
                if problem := self.redis_outage(buffer, exc, lost_s, first):
                    say(f"FAILED: {problem}")
                    return 1
                time.sleep(0.5)
                continue
            if redis_lost_at:  # its outage is not the trainer's stall
                say(f"Redis answers again after {time.monotonic() - redis_lost_at:.0f} s")
                redis_lost_at = 0.0
                watchdog.step_done(watchdog.last_step)
            for entry_id, record in records:
                if self.take(entry_id, record, progress, sinks):
                    watchdog.step_done(record.step)
            if problem := watchdog.check():
                return self.stalled(problem)
            if goal and progress.accuracy >= goal:
                self.outcome = "reached_accuracy"
                return 0
            if self.interrupted:  # (said at once: a second Ctrl-C came before any word)
                self.outcome = "interrupted"
                say(f"interrupted: stopping every service{STOPPING}; Ctrl-C again kills them now")
                return 130
            if problem := restarts.check():  # (before an exit: a service up again says so)
                self.outcome = "child_failed"
                say(f"FAILED: {problem}")
                return 1
            child = self.supervisor.exited()
            if child is not None and not restarts.restart(child):
                done = child.name == "trainer" and child.proc.returncode == 0
                code = self.child_exited(child, buffer.get_version("trainer", 0) if done else 0)
                if done:
                    wait_engines_synced(buffer, say)
                return code
            if time.monotonic() > deadline:
                self.outcome = "time_limit"
                say(f"time limit of {limit_s:.0f}s reached (--time-limit-s)")
                return 1

    def restarts(self, watchdog: Watchdog) -> Restarts:
        """The restarts of engines, router and broker the run allows (never the broker's under
        NCCL: its process groups end with it)."""
        config = self.config
        limits = {"engine": config.engine_restarts, "router": config.router_restarts}
        limits["broker"] = config.broker_restarts if config.run.weight_transport == "zmq" else 0
        timeout_s = config.by_model("startup_timeout_s")
        return Restarts(self.supervisor, limits, timeout_s, say, watchdog)

    def stalled(self, problem: str) -> int:
        """The run's end on the watchdog's `problem`, with the log tail of the service named."""
        self.outcome = "unhealthy" if "unhealthy" in problem else "stalled"
        name = problem.split(" ", 1)[0]
        logs = [c for c in self.supervisor.children if c.name == name]
        tail = f"\n{name} log ({logs[0].log_path}):\n{logs[0].log_tail()}" if logs else ""
        say(f"FAILED: {problem}{tail}")
        return 1

    def redis_outage(
        self, buffer: SampleBuffer, exc: RedisError, lost_s: float, first: bool
    ) -> str:
        """What to say while Redis does not answer (said once, at the start); a problem that
        ends the run once its own server has exited or after --stall-fail-s."""
        url, bound = buffer.config.redis_url, self.config.by_model("stall_fail_s")
        if gone := self.own_redis_gone():
            return gone
        if first:
            say(
                f"Redis at {url} does not answer ({exc}); every service waits for it; the run "
                f"fails after {bound:.0f} s without it (--stall-fail-s)"
            )
        if lost_s >= bound:
            self.outcome = "redis_unavailable"
            return f"Redis at {url} did not answer for {lost_s:.0f} s (--stall-fail-s {bound:.0f})"
        return ""

    def own_redis_gone(self) -> str:
        """The problem when the run's own Redis has exited (outcome redis_failed), else "": it
        comes first, since every service fails after it."""
        own = self.redis.process if self.redis is not None else None
        if own is None or own.poll() is None:
            return ""
        self.outcome = "redis_failed"
        return (
            f"the run's Redis (pid {own.pid}) exited with code {own.returncode} (log: "
            f"{self.run_dir / 'logs' / 'redis.log'}); what it saved is in "
            f"{self.run_dir / 'redis'}: {resume_command(self.run_dir)} goes on from there"
        )

    def take(
        self, entry_id: str, record: MetricsRecord, progress: RunProgress, sinks: MetricSinks
    ) -> bool:
        """One metrics record into the files and the console; True when a step's line came."""
        self.last_metrics_id = entry_id
        sinks.add(record)
        if line := progress.add(record):
            print(line, flush=True)
        if "control/patch" in record.values:  # (the router recorded a PATCH: copied, said)
            self.patches.update()
        return bool(line)

    def drain_metrics(
        self, buffer: SampleBuffer, progress: RunProgress, sinks: MetricSinks
    ) -> None:
        """What the services wrote while they stopped (the trainer's last step, saved with
        its last checkpoint): into metrics.jsonl and the summary like every other record, or
        a resume, which reads on after the stream's end, would never write it."""
        try:
            while records := buffer.read_metrics(after_id=self.last_metrics_id, count=1000):
                for entry_id, record in records:
                    if record.source == "trainer":  # not an eval of engines stopping (no score)
                        self.take(entry_id, record, progress, sinks)
                    self.last_metrics_id = entry_id
        except RedisError as exc:
            say(f"the services' last metrics are not in metrics.jsonl: Redis: {exc}")

    def stop_services(self) -> None:
        """SIGTERM every service, the router first (its groups in flight end as cancelled, their
        prompts given back, while the engines still answer); the trainer saves its last
        checkpoint and the trained model, for up to --stop-timeout-s; then what runs is killed."""
        bound = self.config.stop_timeout_s

        def slow(names: list[str]) -> None:
            say(f"waiting for {', '.join(names)} to stop{STOPPING}; Ctrl-C again kills them now")

        interrupts = len(self.interrupted)
        killed = self.supervisor.stop_all(bound, slow, first=("router",))
        why = "Ctrl-C again" if len(self.interrupted) > interrupts else f"{bound:.0f} s passed"
        for name in killed:
            cut = "; its last save may be cut short (--resume goes on from the last complete one)"
            say(f"{name} killed ({why}; --stop-timeout-s)" + (cut if name == "trainer" else ""))

    @contextmanager
    def writing(self, what: str, whole: bool = False) -> Iterator[None]:
        """A file of the run folder that cannot be written is named on the console; the rest
        of the summary still comes (a full disk must not end the run in a traceback). `whole`:
        `what` is a file written at once, removed when its write failed (never cut short)."""
        try:
            yield
        except OSError as exc:
            if whole:
                (self.run_dir / what).unlink(missing_ok=True)
            say(
                f"could not write {what} in {self.run_dir}: {exc.strerror or exc}{self.disk.note()}"
            )

    def child_exited(self, child, step: int) -> int:  # type: ignore[no-untyped-def]
        """The run's end when `child` exited (the trainer at version `step`)."""
        if child.name == "trainer" and child.proc.returncode == 0:
            if step < self.max_steps:  # (a SIGTERM of its own: it saves, leaves, exit 0)
                self.outcome = "trainer_stopped"
                say(stopped_early(step, self.max_steps, self.run_dir))
                return 1
            reached = self.config.by_model("stop_accuracy") == 0
            self.outcome = "max_steps" if reached else "max_steps_without_accuracy"
            say(f"the trainer reached --max-steps {self.max_steps} (the run's iteration)")
            return 0 if reached else 1
        # (a service exits 2 only on its configuration: the docs' exit code for that)
        refused = child.proc.returncode == 2
        self.outcome = "config_error" if refused else "child_failed"
        if gone := self.own_redis_gone():
            say(f"FAILED: {gone}")
            return 1
        how = "refused its configuration (exit 2)" if refused else child.how_it_ended()
        say(
            f"FAILED: {child.name} {how} "
            f"(log: {child.log_path}):\n{child.exit_reason()}{self.disk.note()}"
        )
        return 2 if refused else 1

    def remove_weight_slots(self) -> None:
        """A killed trainer cannot remove its shared-memory weight slots: do it for it."""
        from services.weight_sync.shm import remove_stale_slots
        from tandem.up_services import shm_dir

        for child in self.supervisor.children:
            if child.name == "trainer":
                remove_stale_slots(shm_dir(), child.proc.pid)

    # --- summary ------------------------------------------------------------------------------

    def write_ledger(self, buffer: SampleBuffer) -> None:
        """RUN_DIR/ledger.json: where every generated group went (`tandem ledger` prints it)."""
        try:
            ledger = buffer.ledger(details=True)
        except RedisError as exc:
            say(f"no ledger.json: Redis did not answer ({exc})")
            return
        self.ledger = ledger.as_dict()
        verdict = "balanced" if ledger.balanced else f"UNBALANCED by {ledger.difference}"
        say(f"ledger: {ledger.sentence()} ({verdict}); see ledger.json or `tandem ledger`")
        if not ledger.balanced and self.outcome in ("max_steps", "reached_accuracy"):
            self.outcome = "ledger_unbalanced"  # (exit 1: a run that lost or doubled work)
            say(
                "FAILED: the ledger does not balance: groups were lost or counted twice (a Redis "
                "that evicted or lost keys?); the run's outcome is ledger_unbalanced"
            )
        (self.run_dir / "ledger.json").write_text(json.dumps(self.ledger, indent=1) + "\n")

    def finish(self, progress: RunProgress, engine_versions: list[str], wall_s: float) -> None:
        trained = self.run_dir / TRAINED_MODEL
        if progress.history:
            try:
                with self.writing("metrics.png"):
                    progress.plot(self.run_dir / "metrics.png")
            except ImportError:  # matplotlib is a dependency, but a GPU image may lack it
                say("matplotlib is not installed: no metrics.png (metrics.jsonl has it all)")
        summary = {
            "outcome": self.outcome,
            "seed": self.config.run.seed,
            **progress.summary(),
            "wall_s": round(wall_s, 1),
            "eval_task": self.eval_task,
            "engine_weight_versions": engine_versions,
            "run_dir": str(self.run_dir),
            "trained_model": str(trained) if trained.is_dir() else None,
            "ledger": self.ledger,
            "checkpoint_step": steps_saved(
                Path(self.tree.value("trainer", "save") or self.run_dir / "checkpoints")
            ),
        }
        with self.writing("summary.json", whole=True):
            write_summary(self.run_dir, summary)
        for sentence in progress.sentences(self.outcome, wall_s, self.eval_task, engine_versions):
            say(sentence)
        if trained.is_dir():
            what = "trained model" if summary["steps"] else "model, untrained (no step ran)"
            say(f"{what} (Hugging Face, with tokenizer): {trained}")
        names = "config.toml metrics.jsonl summary.json ledger.json metrics.png tensorboard/ "
        names += "timeline.json logs/ checkpoints/ redis/"
        there = ", ".join(n for n in names.split() if (self.run_dir / n).exists())
        then = NO_RESUME.get(self.outcome, f"continue it with {resume_command(self.run_dir)}")
        say(f"run folder: {self.run_dir} ({there}); {then}")
