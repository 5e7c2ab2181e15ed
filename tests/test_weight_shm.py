"""Double-buffered shared-memory weight slots: the locking contract, and a real engine on it."""

from __future__ import annotations

import errno
import os
import threading

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.weight_sync.shm import ShmSlots, SlotBusyError, read_slot
from services.weight_sync.zmq_transport import ZmqWeightSender


def tensors(value: float) -> list[tuple[str, torch.Tensor]]:
    return [("a", torch.full((4, 4), value)), ("b", torch.arange(6, dtype=torch.bfloat16) + value)]


def test_a_reader_sees_exactly_the_version_it_was_told_about(tmp_path) -> None:
    slots = ShmSlots(str(tmp_path), timeout_s=1)
    header = slots.write(1, tensors(1.0))
    views, lease = read_slot(header)
    assert torch.equal(views[0][1], torch.full((4, 4), 1.0))
    assert views[1][1].dtype == torch.bfloat16 and views[1][1][-1].item() == 6.0
    lease.release()
    slots.write(2, tensors(2.0))  # the other slot: never the newest version's
    slots.write(3, tensors(3.0))  # back to version 1's slot, which no reader holds
    with pytest.raises(LookupError, match="holds version 3, not 1"):
        read_slot(header)
    slots.close()


def test_the_writer_waits_until_readers_leave_the_slot(tmp_path) -> None:
    slots = ShmSlots(str(tmp_path), timeout_s=0.3, grow_after_s=60)
    header = slots.write(1, tensors(1.0))
    views, lease = read_slot(header)
    slots.write(2, tensors(2.0))  # the other slot: no wait
    with pytest.raises(SlotBusyError):
        slots.write(3, tensors(3.0))  # slot of version 1, still leased
    assert torch.equal(views[0][1], torch.full((4, 4), 1.0))  # the reader's view is intact
    slots.timeout_s = 10
    released = threading.Timer(0.2, lease.release)
    released.start()
    slots.write(3, tensors(3.0))  # proceeds once the lease is released
    slots.close()


def test_a_slot_is_added_while_readers_hold_every_other_one(tmp_path) -> None:
    # Engines two versions behind (a version was lost with a killed broker) hold the slot the
    # next version would reuse: after `grow_after_s` the writer adds one instead of stalling.
    slots = ShmSlots(str(tmp_path), timeout_s=1, grow_after_s=0.1, max_count=3)
    _, lease1 = read_slot(slots.write(1, tensors(1.0)))
    _, lease2 = read_slot(slots.write(2, tensors(2.0)))
    views3, lease3 = read_slot(slots.write(3, tensors(3.0)))
    assert torch.equal(views3[0][1], torch.full((4, 4), 3.0))
    assert len(list(tmp_path.iterdir())) == 3
    with pytest.raises(SlotBusyError, match="all 3 weight slots"):
        slots.write(4, tensors(4.0))  # `max_count` reached: it waits, then says so
    lease1.release()
    views4, lease4 = read_slot(slots.write(4, tensors(4.0)))
    assert torch.equal(views4[0][1], torch.full((4, 4), 4.0))
    for lease in (lease2, lease3, lease4):
        lease.release()
    slots.close()
    assert list(tmp_path.iterdir()) == []


def test_a_real_engine_adopts_shared_memory_weights_and_serves_them(
    start_service, toy_model_dir, tmp_path, monkeypatch, caplog
) -> None:
    engine = start_service("engine", ["engine", "--model", str(toy_model_dir), "--port", "0"])
    broker = start_service("broker", ["broker", "--port", "0", "--engine-urls", engine.url])
    sender = ZmqWeightSender(broker.info["intake_endpoint"], shm_dir=str(tmp_path), timeout_s=30)
    model = AutoModelForCausalLM.from_pretrained(toy_model_dir).eval()
    prompt = [1, 7, 11, 14]
    for version in (1, 2, 3, 4, 5):  # slots are reused from version 3 on
        if version == 5:  # a /dev/shm too small for the weights (a container's 64 MiB)
            sender.close()
            sender = ZmqWeightSender(
                broker.info["intake_endpoint"], shm_dir=str(tmp_path), timeout_s=30
            )
            monkeypatch.setattr(os, "posix_fallocate", no_space)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.05)
        sender.send(version, [(n, t.clone()) for n, t in model.state_dict().items()])
        body = {
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
        }
        for _ in range(200):
            out = httpx.post(f"{engine.url}/generate", json=body, timeout=30).json()
            if out["meta_info"]["weight_version"] == str(version):
                break
        assert out["meta_info"]["weight_version"] == str(version)
        tokens = [t[1] for t in out["meta_info"]["output_token_logprobs"]]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0], -1)
        expected = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]
        got = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-4
    assert "0 tensors copied" not in engine.log()
    # version 5 did not fit (the write would have been SIGBUS): it went in ZMQ frames, said so
    assert sender.slots is None
    assert (
        f"does not fit in {tmp_path}" in caplog.text and "in ZMQ frames from now on" in caplog.text
    )
    sender.close()


def no_space(fd: int, offset: int, length: int) -> None:
    """os.posix_fallocate on a full tmpfs."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
