"""The router's HTTP app: `create_app(config)` wires the worker pool, the rollout loop and routes.

Lifespan: start the shared HTTP session, admit every `--engine-urls` engine (waiting with
backoff; an engine that never answers fails start-up naming its URL), connect to Redis, load the
tokenizer once, take out the engines whose context cannot hold the response bound (none left
fails start-up naming them: balancer/engine_context.py), then start the health-check task and, unless
`--no-rollout`, the rollout and evaluation tasks. Shutdown cancels those tasks and closes the session.

Routes are thin: engine-compatible routes (`/generate`, `/v1/*`, `/get_model_info`, fan-out
control) live in `balancer/routes_engine.py`, the worker registry in `balancer/routes_workers.py`,
rollout control in `rollout/routes_control.py`;
the dashboard page (`/`) and its read-only routes in `routes_dashboard.py`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from proto.contract import RunContract
from proto.models import read_config
from services.common.tokenizers import load_tokenizer
from services.common.validation import answer_invalid_bodies
from services.rollout_router.backpressure import depth_note
from services.rollout_router.balancer.engine_context import ContextGate
from services.rollout_router.balancer.routes_engine import router as engine_router
from services.rollout_router.balancer.routes_workers import router as workers_router
from services.rollout_router.balancer.workers import WorkerPool
from services.rollout_router.config import DataConfig, RouterConfig, SamplingConfig, check
from services.rollout_router.gateway.chat_input import TemplateKwargs
from services.rollout_router.gateway.routes_agent import router as agent_router
from services.rollout_router.gateway.sessions import AgentSessions
from services.rollout_router.lease import RouterLease
from services.rollout_router.rollout.control import (
    RolloutController,
    filter_problem,
    greedy_note,
)
from services.rollout_router.rollout.environments import EnvClient, EpisodeRunner
from services.rollout_router.rollout.loop import RolloutLoop
from services.rollout_router.rollout.metrics import router as metrics_router
from services.rollout_router.rollout.rewards import make_reward
from services.rollout_router.rollout.routes_control import router as control_router
from services.rollout_router.rollout.tasks import (
    DATASET_RESPONSE_LEN,
    TOY_RESPONSE_LEN,
    Task,
    data_term,
    dataset_task,
    toy_reverse_digits,
)
from services.rollout_router.routes_dashboard import router as dashboard_router
from services.sample_buffer import AsyncSampleBuffer

log = logging.getLogger("tandem.router")


def stop_ids(tokenizer: Any, sampling: SamplingConfig) -> list[int]:
    """Configured stop token ids plus the tokenizer's EOS; warns when nothing would stop."""
    ids = list(sampling.rollout_stop_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and eos not in ids:
        ids.append(int(eos))
    if not ids and not sampling.rollout_stop:
        log.warning(
            "the tokenizer of --model has no end-of-sequence token and neither "
            "--rollout-stop nor --rollout-stop-token-ids is set: every rollout will run to "
            "--rollout-max-response-len"
        )
    return ids


def build_task(data: DataConfig, tokenizer: Any, context_len: int = 0) -> Task:
    """The toy task, or the datasets named by `data` (without the prompts that fill the
    model's `context_len` positions)."""
    if not data.prompt_data:
        return toy_reverse_digits(tokenizer, data.task_seed)
    paths, keys = (data.prompt_data, data.eval_prompt_data), (data.input_key, data.label_key)
    held_out = (data.eval_heldout_fraction, data.task_seed)
    chat, most = data.apply_chat_template, data.eval_max_prompts
    return dataset_task(tokenizer, *paths, *keys, chat, *held_out, context_len, most)


def default_response_len(config: RouterConfig, task: Task, context: int) -> int:
    """The task's response length (an environment's: a dataset's), within the model's context
    after the longest prompt (`context` positions, 0: unknown); logged, since no flag set it."""
    length = DATASET_RESPONSE_LEN if config.env.env_url else task.response_len
    what = f"environment {config.env.env_url}" if config.env.env_url else f"task {task.name}"
    longest = task.longest_prompt
    if context and length > context - longest:
        length = max(1, context - longest)
        what += f", cut to the model's {context} positions after a {longest}-token prompt"
    (log.warning if length > TOY_RESPONSE_LEN else log.info)(
        "responses up to %d tokens (the default for %s; --rollout-max-response-len sets it)",
        length,
        what,
    )
    return length


async def build_control(
    config: RouterConfig, pool: WorkerPool, buffer: AsyncSampleBuffer, lease: RouterLease
) -> RolloutController:
    """Tokenizer, task and reward, loaded once (the prompts' term of the run contract agreed
    through `lease`'s run membership); the rollout loop and its controller."""
    tokenizer = await asyncio.to_thread(load_tokenizer, config.run.model)
    if template := config.data.template_kwargs():
        tokenizer = TemplateKwargs(tokenizer, template)
    context = int(read_config(config.run.model)[0].get("max_position_embeddings", 0))
    make_task = functools.partial(build_task, context_len=context)
    task = await asyncio.to_thread(make_task, config.data, tokenizer)
    # (a router restarted on other prompts than the run's: ContractMismatchError, exit 2)
    await asyncio.to_thread(lease.member.agree, RunContract(data=data_term(task)))
    if problem := filter_problem(config.sampling):  # (exit 2, as a bad flag)
        raise ValueError(problem)
    if greedy := greedy_note(config.sampling, config.run.n_samples_per_prompt):
        task.notes += (greedy,)  # (tandem up refuses it with a group-relative trainer)
    for note in task.notes:
        log.warning("%s", note)
    if not config.sampling.rollout_max_response_len:
        config.sampling.rollout_max_response_len = default_response_len(config, task, context)
    reward = await make_reward(config.reward, pool.session)
    episodes = None
    if config.env.env_url:
        assert pool.session is not None
        client = EnvClient(config.env.env_url, pool.session, config.env.env_call_timeout_s)
        chat = config.data.apply_chat_template
        episodes = EpisodeRunner(config.env, client, tokenizer, chat, context)
    stops, settings = stop_ids(tokenizer, config.sampling), (config.rollout, config.sampling)
    loop = RolloutLoop(config.run, *settings, pool, buffer, task, reward, stops, episodes)
    loop.gen.context_len = context
    return RolloutController(loop, config.data, tokenizer, make_task, config.scored())


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    config: RouterConfig = app.state.config
    pool = WorkerPool(config.workers)
    await pool.start()
    app.state.control = app.state.sessions = None
    buffer = AsyncSampleBuffer(config.buffer_config())
    lease = RouterLease(buffer)
    try:
        await pool.add_all(config.workers.engine_urls, config.workers.engine_wait_timeout_s)
        await buffer.wait_ready(30.0)
        app.state.pool, app.state.buffer = pool, buffer
        pool.start_health_checks()
        if config.run.model:  # (it writes the run's samples: one router per run)
            await lease.take()
            await buffer.recover_open("router")  # (a killed router's agent sessions)
            control = app.state.control = await build_control(config, pool, buffer, lease)
            loop = control.loop  # (a PATCH replaces loop.sampling)
            gate = ContextGate(pool, lambda: loop.sampling.rollout_max_response_len)
            await gate.refuse_short()  # (the response bound is known now: build_control)
            control.context_gate = gate
            await control.replay()  # (the run's PATCHes: a resume or a restart keeps them)
            app.state.sessions = AgentSessions(
                config.sessions,
                pool,
                control.loop.bound,
                control.tokenizer,
                control.loop.gen.stop_token_ids,
                config.run.n_samples_per_prompt,
            )
            if note := depth_note(config):
                log.info("%s", note)
            control.start_tasks(lease)
            if config.rollout.rollout:
                control.start()
            else:  # what the watchdog shows while a trainer waits for samples
                control.loop.set_state(
                    "rollouts off",
                    "nothing: rollouts are off (--no-rollout); samples come only from agent "
                    "sessions (POST /v1/chat/completions, then /sessions/{id}/reward)",
                )
        yield
    except Exception as exc:
        app.state.startup_error = exc
        raise
    finally:
        if app.state.sessions is not None:
            await app.state.sessions.close()
        if app.state.control is not None:
            await app.state.control.close()
        await lease.release()
        await pool.close()
        await buffer.aclose()
        log.info("router stopped: tasks cancelled, engine session closed")


def create_app(config: RouterConfig) -> FastAPI:
    config.validate()
    if problems := check(config):  # (the model's folder, data files, a custom reward)
        raise ValueError(problems[0])
    app = FastAPI(
        title="Tandem rollout router",
        description="Balances SGLang-compatible engines and runs RL rollouts into Redis.",
        lifespan=lifespan,
    )
    app.state.config = config
    app.state.api_token = config.api_token
    app.state.startup_error = None  # what failed the lifespan's start (__main__.run raises it)
    app.include_router(engine_router)
    app.include_router(workers_router)
    app.include_router(control_router)
    app.include_router(agent_router)
    app.include_router(dashboard_router)
    app.include_router(metrics_router)
    answer_invalid_bodies(app)
    return app
