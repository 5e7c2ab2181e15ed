"""Grouped-GEMM experts (`grouped_experts.GroupedExperts`) against megatron's `SequentialMLP`.

Two policies load the same tiny Qwen3-MoE, one with each kind of experts, and run the same
micro-batches with routing replay on (random expert choices per token): log-probs, gradients
and the weights after an AdamW step agree (fp32, CPU), in one process and at expert-parallel
size 2 (two gloo processes). Checkpoints written by either load into the other.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from megatron.core.transformer.moe.moe_layer import MoELayer

from services.trainer import batching
from services.trainer.config import TrainerConfig
from services.trainer.expert_dispatch import SortedDispatcher
from services.trainer.grouped_experts import GroupedExperts, expert_views
from services.trainer.policy import Policy
from tests.test_trainer_hf_convert import megatron_world  # noqa: F401 - fixture
from tests.tiny_models import write_tiny

TOL = 1e-5  # fp32: the same products, summed in another order at most


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("grouped") / "m", "qwen3_moe", num_experts=8)


def policy(model_dir: Path, grouped: bool, **overrides) -> Policy:  # type: ignore[no-untyped-def]
    if not grouped:  # (grouped: the default, which the tests below check is grouped)
        overrides["moe_grouped_experts"] = False
    cfg = TrainerConfig(model=str(model_dir), use_routing_replay=True, lr=1e-2, **overrides)
    return Policy(cfg, str(model_dir))


def micro_batches(policy: Policy, seed: int, equal: bool = False) -> list[batching.MicroBatch]:
    """Packed micro-batches of random samples, each token routed to random distinct experts;
    `equal`: 6 of 48 tokens each (what expert-parallel ranks must run, `batching.equalize`)."""
    rng = np.random.default_rng(seed)
    samples = [
        batching.TrainSample(
            tokens=rng.integers(3, 16, size=6 + n),
            prompt_len=6,
            behaviour_logp=np.full(n, -2.0, dtype=np.float32),
            loss_mask=np.ones(n, dtype=np.float32),
            advantages=np.full(n, rng.normal(), dtype=np.float32),
            weight_version=0,
            reward=0.0,
        )
        for n in rng.integers(2, 20, size=6)
    ]
    mbs = batching.make_micro_batches(samples, True, 48, 4)
    if equal:
        mbs = batching.equalize(mbs, 6, 48)
    arch, gen = policy.arch, torch.Generator().manual_seed(seed)
    for mb in mbs:
        rows, width = mb.input_ids.shape
        scores = torch.rand(rows, width, arch.num_layers, arch.num_experts, generator=gen)
        mb.routed_experts = scores.topk(arch.moe_topk, dim=-1).indices
    return mbs


def loss(mb: batching.MicroBatch, logp: torch.Tensor, _entropy: torch.Tensor | None):  # type: ignore[no-untyped-def]
    """Advantage-weighted log-likelihood of the response tokens, summed (megatron divides)."""
    mask = mb.loss_mask.to(logp.device)
    adv = mb.advantages.to(logp.device)
    return -(logp * adv * mask).sum(), mask.sum().int(), {}


def by_name(p: Policy, grads: bool) -> dict[str, torch.Tensor]:
    """Weights (or their gradients) under SequentialMLP's names, per expert."""
    if not grads:
        return {n: t.detach().clone() for n, t in expert_views(p.model)}
    out = {}
    for name, param in p.model.named_parameters():
        grad = param.main_grad.detach().clone()
        if name.endswith(("experts.weight1", "experts.weight2")):
            linear = "linear_fc1" if name.endswith("1") else "linear_fc2"
            head = name.rpartition(".")[0]
            out.update({f"{head}.local_experts.{j}.{linear}.weight": g for j, g in enumerate(grad)})
        else:
            out[name] = grad
    return out


def compare(grouped: Policy, sequential: Policy, mbs: list[batching.MicroBatch]) -> float:
    """Asserts equal log-probs, gradients and stepped weights; returns the largest difference."""
    logps = [[o["logp"] for o in p.logprobs(mbs)] for p in (grouped, sequential)]
    worst = max((a - b).abs().max().item() for a, b in zip(*logps, strict=True))
    assert worst < TOL, f"log-probs differ by {worst}"
    weights_before = by_name(sequential, grads=False)
    for p in (grouped, sequential):
        _, applied, _ = p.train_step(mbs, loss, with_entropy=False)
        assert applied
    for kind in (True, False):  # gradients (kept in main_grad until the next step), weights
        a, b = by_name(grouped, kind), by_name(sequential, kind)
        assert set(a) == set(b) and any(".local_experts.3." in n for n in a)
        for name in a:
            diff = (a[name] - b[name]).abs().max().item()
            assert diff < TOL, f"{'gradient' if kind else 'weight'} {name} differs by {diff}"
            worst = max(worst, diff)
    moved = [(b[n] - weights_before[n]).abs().max().item() for n in b if "local_experts" in n]
    assert min(moved) > 1e-4  # every expert was trained (a test that cannot pass vacuously)
    return worst


def test_grouped_experts_give_sequential_experts_log_probs_gradients_and_adam_step(
    megatron_world: None,  # noqa: F811
    moe_dir: Path,
) -> None:
    grouped, sequential = policy(moe_dir, True), policy(moe_dir, False)
    assert any(isinstance(m, GroupedExperts) for m in grouped.model.modules())
    assert not any(isinstance(m, GroupedExperts) for m in sequential.model.modules())
    # the grouped model dispatches with SortedDispatcher, the sequential one with megatron's
    kinds = [
        {type(m.token_dispatcher) for m in p.model.modules() if isinstance(m, MoELayer)}
        for p in (grouped, sequential)
    ]
    assert kinds[0] == {SortedDispatcher} and SortedDispatcher not in kinds[1]
    assert grouped.replays and len(grouped.replays) == len(sequential.replays)
    mbs = micro_batches(grouped, seed=0)
    assert len(mbs) > 1
    compare(grouped, sequential, mbs)


def _ep2_worker(rank: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        CUDA_VISIBLE_DEVICES="",
    )
    torch.set_num_threads(1)
    from services.trainer.policy import init_distributed

    init_distributed(tp_size=1, seed=0, ep_size=2)
    extra = dict(expert_model_parallel_size=2)
    grouped = policy(Path(model_dir), True, **extra)
    sequential = policy(Path(model_dir), False, **extra)
    worst = compare(grouped, sequential, micro_batches(grouped, 10 + rank, equal=True))
    Path(out, f"rank{rank}").write_text(f"{worst}")


def test_at_expert_parallel_size_2_grouped_and_sequential_experts_train_alike(
    moe_dir: Path, tmp_path: Path
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ep2_worker, args=(port, str(moe_dir), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        assert float((tmp_path / f"rank{rank}").read_text()) < TOL


def checkpoint_roundtrip(source: Policy, target: Policy, root: Path) -> None:
    from services.trainer.checkpoint import Checkpointer

    source.cfg.checkpoint.save = str(root)
    Checkpointer(source.cfg, source).save(1, [], 0)
    target.cfg.checkpoint.save = str(root)
    Checkpointer(target.cfg, target).load(root)


@pytest.mark.parametrize("direction", ["grouped_to_sequential", "sequential_to_grouped"])
def test_a_checkpoint_of_either_kind_of_experts_resumes_with_the_other(
    megatron_world: None,  # noqa: F811
    moe_dir: Path,
    tmp_path: Path,
    direction: str,
) -> None:
    first_grouped = direction.startswith("grouped")
    source, target = policy(moe_dir, first_grouped), policy(moe_dir, not first_grouped)
    mbs = micro_batches(source, seed=3)
    source.train_step(mbs, loss, with_entropy=False)  # weights and Adam moments off the start
    checkpoint_roundtrip(source, target, tmp_path / "ckpt")
    a, b = by_name(source, grads=False), by_name(target, grads=False)
    assert set(a) == set(b)
    assert all(torch.equal(a[n], b[n]) for n in a)
    # the Adam moments came along: one more identical step keeps them identical
    for p in (source, target):
        p.train_step(mbs, loss, with_entropy=False)
    a, b = by_name(source, grads=False), by_name(target, grads=False)
    worst = max((a[n] - b[n]).abs().max().item() for n in a)
    assert worst < TOL, worst


def test_the_grouped_experts_export_the_hf_names_of_the_sequential_ones(
    megatron_world: None,  # noqa: F811
    moe_dir: Path,
) -> None:
    grouped, sequential = policy(moe_dir, True), policy(moe_dir, False)
    a, b = dict(grouped.export_hf()), dict(sequential.export_hf())
    assert set(a) == set(b) and "model.layers.1.mlp.experts.7.down_proj.weight" in a
    assert all(torch.equal(a[n], b[n]) for n in a)
    c = dict(grouped.export_hf(on_device=True))
    assert all(torch.equal(a[n], c[n]) for n in a)
