"""Code lines per feature of each over-budget folder, counted as tests/test_house.py counts them
(not blank, comment or docstring; attribute docstrings are docstrings).

Run: python tests/house_features.py
Each folder's files are split into features by the map below: a spec is a file (relative to the
folder), `file:Name` (a top-level def or class) or `file:Class.method`; the most specific spec
claims a line. Lines no spec claims are printed as "(unmapped)", so every line is counted once
and the features sum to the folder's total (checked against test_house.folder_lines()).
Kind: core = the folder's job, without it the service does not run; opt = a feature a run can be
without (a user may still need it).

STYLE.md item 14: a folder over its budget names the features that cost it; this is that list,
measured, for the folders in test_house.OVER_BUDGET_TODAY."""

import ast
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_house import BUDGETS, ROOT, code_line_set, folder_lines

C, OPT = "core", "opt"
MAP: dict[str, list[tuple[str, str, list[str]]]] = {
    "tandem": [
        ("`tandem` dispatch", C, ["cli.py"]),
        (
            "tandem up: config tree, flags, checks",
            C,
            ["launcher.py", "up_launch.py", "up_tree.py", "up_config.py", "up_services.py"],
        ),
        (
            "tandem up: start, monitor, stop, summary",
            C,
            ["up_run.py", "supervisor.py", "run_dir.py", "__init__.py"],
        ),
        (
            "tandem up --resume (saved config, checkpoint checks)",
            OPT,
            [
                "up_args.py",
                "run_dir.py:resume_command",
                "run_dir.py:kept_configuration",
                "run_dir.py:restore_files",
            ],
        ),
        (
            "restarts of engines/router/broker mid-run",
            OPT,
            ["up_engines.py", "up_run.py:UpRun.restarts", "up_run.py:UpRun.child_exited"],
        ),
        ("engines synced at the end", OPT, ["up_engines.py:wait_engines_synced"]),
        ("watchdog: health + stall diagnosis", OPT, ["watchdog.py", "up_run.py:UpRun.stalled"]),
        (
            "Redis outage / own Redis gone handling",
            OPT,
            ["up_run.py:UpRun.redis_outage", "up_run.py:UpRun.own_redis_gone"],
        ),
        ("disk-full watch", OPT, ["run_dir.py:DiskWatch"]),
        ("progress console + metrics.jsonl", C, ["progress.py"]),
        ("PNG plot of the run", OPT, ["progress.py:RunProgress.plot"]),
        ("TensorBoard event writer", OPT, ["tensorboard.py"]),
        ("W&B sink", OPT, ["sinks.py"]),
        (
            "tandem ledger (+ ledger.json at the end)",
            OPT,
            ["ledger_cli.py", "up_run.py:UpRun.write_ledger"],
        ),
        ("tandem metrics", OPT, ["metrics_cli.py"]),
        (
            "tandem timeline (+ timeline.json at the end)",
            OPT,
            ["timeline_cli.py", "run_dir.py:write_timeline"],
        ),
        ("run lookup for the read CLIs (run_redis)", OPT, ["run_redis.py"]),
        ("tandem config show/reference", OPT, ["config_cmd.py"]),
        ("PATCH changes said on the console + RUN_DIR/patches.jsonl", OPT, ["patches.py"]),
        ("--model ORG/NAME from the HF cache", OPT, ["hub.py"]),
        (
            "built-in toy model + tandem toy-model",
            OPT,
            ["toy_model.py", "toy_model_cli.py", "up_run.py:UpRun.write_model"],
        ),
    ],
    "services/common": [
        ("one config loader (settings.py)", C, ["settings.py"]),
        (
            "run a service: exit codes, bind, ready file, graceful stop",
            C,
            ["serving.py", "__init__.py", "long_wait.py", "paths.py"],
        ),
        ("503 for requests cut by the graceful stop", OPT, ["serving.py:StoppingReply"]),
        ("Prometheus /metrics exposition", OPT, ["metrics.py"]),
        ("chat messages as SGLang templates them", OPT, ["chat_messages.py"]),
        ("tokenizer loading + checks", C, ["tokenizers.py"]),
        (
            "vocabulary check of a second model (reference/critic)",
            OPT,
            ["tokenizers.py:vocabulary_problem"],
        ),
        ("4xx for bad bodies (lone surrogates, 422 as JSON)", OPT, ["validation.py"]),
        ("413 body limit", OPT, ["body_limit.py"]),
        ("bearer token", C, ["auth.py"]),
        ("engine info (weight version, server info)", C, ["engine_info.py"]),
        ("HF weight files", C, ["hf_weights.py"]),
        ("URL fields", C, ["urls.py"]),
    ],
    "services/engine": [
        (
            "generation core: scheduler, model runner, sampler, /generate",
            C,
            [
                "scheduler.py",
                "model_runner.py",
                "sampling.py",
                "api.py",
                "engine.py",
                "server.py",
                "web.py",
                "config.py",
                "__main__.py",
                "__init__.py",
            ],
        ),
        ("prompt cache", OPT, ["prompt_cache.py", "model_runner.py:merge_prefilled"]),
        ("weight updates: apply, ZMQ, disk", C, ["weights.py", "server.py:_add_weight_routes"]),
        (
            "weight updates by NCCL/gloo broadcast (+ layout ids, bucket sizes)",
            OPT,
            [
                "weight_layout.py",
                "weights.py:WeightUpdater.init_group",
                "weights.py:WeightUpdater.destroy_group",
                "weights.py:WeightUpdater._join_bound",
                "weights.py:WeightUpdater._join",
                "weights.py:WeightUpdater.from_distributed",
                "weights.py:WeightUpdater._prepared_layout",
                "weights.py:WeightUpdater._flat_bucket_sizes",
                "weights.py:WeightUpdater._receive",
                "weights.py:WeightUpdater._receive_set",
                "weights.py:WeightUpdater._wait",
                "weights.py:WeightUpdater._synchronize",
            ],
        ),
        ("OpenAI routes /v1/*", OPT, ["openai_api.py"]),
        ("/metrics", OPT, ["metrics.py"]),
        (
            "release/resume memory (colocated)",
            OPT,
            ["engine.py:Engine.release_memory", "engine.py:Engine.resume_memory"],
        ),
        ("streaming /generate", OPT, ["engine.py:Engine.stream", "server.py:_sse"]),
        ("KV budget check against free memory", OPT, ["engine.py:kv_budget"]),
    ],
    "services/rollout_router": [
        (
            "service entry, config, app wiring, lease",
            C,
            ["__main__.py", "config.py", "config_checks.py", "app.py", "lease.py", "__init__.py"],
        ),
        (
            "balancer: workers, health, retries, engine routes",
            C,
            [
                "balancer/workers.py",
                "balancer/worker.py",
                "balancer/routes_engine.py",
                "balancer/routes_workers.py",
                "balancer/engine_context.py",
                "balancer/__init__.py",
            ],
        ),
        (
            "HTTP/1 client + ASGI fast path (speed)",
            OPT,
            ["balancer/http1.py", "balancer/fastpath.py"],
        ),
        ("streamed requests through the router", OPT, ["balancer/streaming.py"]),
        (
            "rollout loop, generation, samples, control",
            C,
            [
                "rollout/loop.py",
                "rollout/generation.py",
                "samples.py",
                "rollout/progress.py",
                "rollout/limiter.py",
                "rollout/settings.py",
                "rollout/control.py",
                "rollout/routes_control.py",
                "rollout/calls.py",
                "rollout/toy_task.py",
                "rollout/__init__.py",
            ],
        ),
        ("dataset files (JSONL/Parquet) and tasks", OPT, ["rollout/tasks.py"]),
        (
            "multi-turn environments",
            OPT,
            ["rollout/environments.py", "rollout/loop.py:RolloutLoop._episode_samples"],
        ),
        ("rewards: built-in, Python function, remote", C, ["rollout/rewards.py"]),
        ("--custom-rm-path checks", OPT, ["rollout/custom_reward.py"]),
        ("reward worker processes (--rm-workers)", OPT, ["rollout/reward_workers.py"]),
        ("held-out evaluation", OPT, ["rollout/evaluation.py"]),
        ("rollout report (metrics per batch, drops, status)", C, ["rollout/report.py"]),
        ("back-pressure (buffer depth bound)", OPT, ["backpressure.py"]),
        ("/metrics + timeline spans", OPT, ["rollout/metrics.py"]),
        ("dashboard", OPT, ["routes_dashboard.py", "rollout/recent.py"]),
        (
            "agent gateway: sessions, chat input, tool calls",
            OPT,
            [
                "gateway/sessions.py",
                "gateway/session_store.py",
                "gateway/chat_input.py",
                "gateway/routes_agent.py",
                "gateway/tool_calls.py",
                "gateway/__init__.py",
            ],
        ),
    ],
    "services/trainer": [
        (
            "training loop, entry, config, status, lease, lineage",
            C,
            [
                "trainer.py",
                "__main__.py",
                "config.py",
                "status.py",
                "lease.py",
                "lineage.py",
                "stats.py",
                "__init__.py",
            ],
        ),
        (
            "megatron model, optimizer, passes",
            C,
            [
                "policy.py",
                "step_math.py",
                "losses.py",
                "hf_arch.py",
                "packed_attention.py",
                "cpu_compat.py",
            ],
        ),
        ("intake: read, check, batch, pack", C, ["rollout.py", "intake.py", "batching.py"]),
        (
            "HF <-> megatron weights (load at start, publish HF names)",
            C,
            ["hf_convert.py", "hf_files.py"],
        ),
        ("tandem convert (CLI)", OPT, ["convert.py"]),
        ("checkpoints + resume", C, ["checkpoint.py", "ckpt_folder.py"]),
        ("Redis reconnect waits", OPT, ["redis_wait.py"]),
        ("PPO critic", OPT, ["critic.py"]),
        ("grouped MoE experts (speed)", OPT, ["grouped_experts.py"]),
        ("MoE routing replay", OPT, ["routing_replay.py"]),
        ("metrics record, /metrics, stdout line", OPT, ["observe.py"]),
    ],
    "services/weight_broker": [
        (
            "broker loop, entry, config, version store, HTTP",
            C,
            ["broker.py", "__main__.py", "config.py", "store.py", "server.py", "__init__.py"],
        ),
        ("ZMQ bucket transport", C, ["transports.py"]),
        ("disk transport", OPT, ["transports.py:DiskTransport"]),
        ("NCCL transport", OPT, ["nccl_transport.py"]),
        ("/metrics (sync histogram, counts)", OPT, ["server.py:SyncObserver"]),
    ],
    "services/sample_buffer": [
        (
            "buffer: keys, sync + async clients",
            C,
            ["buffer.py", "keys.py", "aio.py", "__init__.py", "read_ahead.py", "password.py"],
        ),
        ("ledger + recovery", OPT, ["ledger.py", "recovery.py"]),
        (
            "membership: lease, fence, contract, store checks",
            C,
            ["membership.py", "store_check.py", "refusals.py"],
        ),
        ("start a Redis server", C, ["server.py"]),
        ("timeline stream", OPT, ["timeline.py"]),
    ],
}


def spans(path: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for node in ast.parse(path.read_text()).body:
        if hasattr(node, "name"):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out[node.name] = (start, node.end_lineno)
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if hasattr(sub, "name"):
                        a = min(
                            [sub.lineno] + [d.lineno for d in getattr(sub, "decorator_list", [])]
                        )
                        out[f"{node.name}.{sub.name}"] = (a, sub.end_lineno)
    return out


def measure(folder: str) -> tuple[list[tuple[str, str, int]], dict[str, int]]:
    base = ROOT / folder
    owner: dict[tuple[str, int], tuple[int, str]] = {}  # (file, line) -> (specificity, feature)
    for feature, _kind, specs in MAP[folder]:
        for spec in specs:
            file, _, name = spec.partition(":")
            path = base / file
            if not path.exists():
                continue
            lines = code_line_set(path.read_text())
            if name:
                if name not in spans(path):  # (gone since the map was written: counts 0)
                    continue
                a, b = spans(path)[name]
                lines = {n for n in lines if a <= n <= b}
            rank = name.count(".") + 1 if name else 0
            for n in lines:
                if owner.get((file, n), (-1, ""))[0] < rank:
                    owner[(file, n)] = (rank, feature)
    counts: dict[str, int] = defaultdict(int)
    unmapped: dict[str, int] = defaultdict(int)
    for path in base.rglob("*.py"):
        file = str(path.relative_to(base))
        for n in code_line_set(path.read_text()):
            if (file, n) in owner:
                counts[owner[(file, n)][1]] += 1
            else:
                unmapped[file] += 1
    rows = [(f, k, counts[f]) for f, k, _ in MAP[folder]]
    return rows, dict(unmapped)


def main() -> None:
    totals = folder_lines()
    for folder in MAP:
        rows, unmapped = measure(folder)
        total = sum(n for *_, n in rows) + sum(unmapped.values())
        assert total == totals[folder], (folder, total, totals[folder])
        over = total - BUDGETS[folder]
        print(f"\n### {folder}: {total} code lines, budget {BUDGETS[folder]}, over by {over}\n")
        print("| Feature | Kind | Code lines | Where |\n|---|---|---|---|")
        where = {f: ", ".join(specs) for f, _, specs in MAP[folder]}
        for feature, kind, n in sorted(rows, key=lambda r: (r[1] != "core", -r[2])):
            print(f"| {feature} | {kind} | {n} | {where[feature]} |")
        for file, n in sorted(unmapped.items()):
            print(f"| (unmapped: {file}) | ? | {n} | |")
        core = sum(n for _, k, n in rows if k == C)
        print(f"| **core total** | | **{core}** | |")


if __name__ == "__main__":
    main()
