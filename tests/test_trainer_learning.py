"""The trainer learns the toy task: a real `tandem trainer` subprocess against a real Valkey, with
this test as the rollout side (sampling from `transformers` with the weights the trainer sends
over ZMQ), so reward and held-out accuracy must rise if loss, signs and weight export are right."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq

from proto import Sample, SampleGroup
from services.rollout_router.rollout.toy_task import (
    is_exact,
    reverse_digits_reward,
    reverse_digits_split,
)
from tests.test_trainer_process import bind_pull, common_args, receive_version

EOS, DIGIT0, ARROW = 2, 4, 14


def prompt_ids(prompt: str) -> list[int]:
    return [1] + [DIGIT0 + int(c) for c in prompt[:2]] + [ARROW]


def text_of(ids: list[int]) -> tuple[str, bool]:
    out = []
    for t in ids:
        if t == EOS:
            return "".join(out), True
        out.append(str(t - DIGIT0) if DIGIT0 <= t < DIGIT0 + 10 else "?")
    return "".join(out), False


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new: int, greedy: bool, gen: torch.Generator):  # type: ignore[no-untyped-def]
    """All prompts have the same length; returns (response ids, log-probs) per row."""
    ids = torch.tensor(prompts)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    responses: list[list[int]] = [[] for _ in prompts]
    logps: list[list[float]] = [[] for _ in prompts]
    for _ in range(max_new):
        logits = model(ids).logits[:, -1].float().log_softmax(-1)
        nxt = (
            logits.argmax(-1)
            if greedy
            else torch.multinomial(logits.exp(), 1, generator=gen).squeeze(1)
        )
        for i in range(len(prompts)):
            if not done[i]:
                responses[i].append(int(nxt[i]))
                logps[i].append(float(logits[i, nxt[i]]))
        done |= nxt == EOS
        ids = torch.cat([ids, nxt.unsqueeze(1)], 1)
        if done.all():
            break
    return responses, logps


def heldout_accuracy(model, heldout, gen) -> float:  # type: ignore[no-untyped-def]
    responses, _ = generate(model, [prompt_ids(it.prompt) for it in heldout], 3, True, gen)
    return sum(
        is_exact(text_of(r)[0], it.label, text_of(r)[1])
        for r, it in zip(responses, heldout, strict=True)
    ) / len(heldout)


@pytest.mark.slow
def test_reward_and_heldout_accuracy_rise_on_the_toy_task(buffer, toy_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    steps, groups_per_step, n = int(os.environ.get("LEARN_STEPS", "90")), 64, 8
    model = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()
    train_items, heldout = reverse_digits_split()
    gen = torch.Generator().manual_seed(0)
    acc_before = heldout_accuracy(model, heldout, gen)
    sock, endpoint = bind_pull()
    sock.setsockopt(zmq.RCVTIMEO, 60_000)
    # the common flags (the toy's --lr 1e-3 among them), then this test's batch and reads
    cmd = [sys.executable, "-m", "tandem.cli", "trainer"]
    cmd += common_args(toy_model_dir, buffer, endpoint)
    cmd += ["--rollout-batch-size", str(groups_per_step), "--n-samples-per-prompt", str(n)]
    cmd += ["--max-steps", str(steps), "--max-staleness", "0", "--read-block-ms", "100"]
    cmd += os.environ.get("LEARN_ARGS", "").split()
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"trainer-learn-{os.getpid()}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rewards = []
    try:
        for version in range(steps):
            items = [
                train_items[(version * groups_per_step + i) % len(train_items)]
                for i in range(groups_per_step)
            ]
            prompts = [prompt_ids(it.prompt) for it in items for _ in range(n)]
            responses, logps = generate(model, prompts, 3, False, gen)
            groups = []
            for g, it in enumerate(items):
                samples = []
                for j in range(g * n, (g + 1) * n):
                    text, stopped = text_of(responses[j])
                    r = reverse_digits_reward(text, it.label, stopped)
                    samples.append(
                        Sample(
                            prompt_ids=prompts[j],
                            response_ids=responses[j],
                            response_logprobs=logps[j],
                            loss_mask=[1] * len(responses[j]),
                            reward=r,
                            weight_version=version,
                        )
                    )
                groups.append(
                    SampleGroup(
                        group_id=f"{version}-{g}",
                        prompt=it.prompt,
                        label=it.label,
                        samples=samples,
                        weight_version=version,
                        created_at=time.time(),
                    )
                )
            for grp in groups:
                buffer.put_group(grp)
            rewards.append(
                sum(s.reward for grp in groups for s in grp.samples) / (groups_per_step * n)
            )
            got, tensors = receive_version(sock)
            assert got == version + 1
            model.load_state_dict(tensors, strict=False)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close(linger=0)
        log.close()
    acc_after = heldout_accuracy(model, heldout, gen)
    print(
        f"reward first5 {sum(rewards[:5]) / 5:.3f} last5 {sum(rewards[-5:]) / 5:.3f} "
        f"heldout acc {acc_before:.2f} -> {acc_after:.2f}"
    )
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.2
    assert acc_after >= 0.3 and acc_after > acc_before
