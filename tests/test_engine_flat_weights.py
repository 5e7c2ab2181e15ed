"""`/update_weights_from_distributed` with `load_format: "flattened_bucket"` and `bucket_sizes`
on a real `tandem engine` process; the test process is the trainer (rank 0 of a gloo group).

The model is a tied Llama whose hidden size is odd, so bfloat16 tensors of odd length put the
float32 tensors after them at byte offsets that are not multiples of 4: the engine must copy
those out of the flat buffer instead of viewing them. The flat path must end with exactly the
weights the per-tensor path gives.
"""

from __future__ import annotations

import concurrent.futures
import json
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

from services.engine.weight_layout import PreparedLayout, ReceiveSet
from services.weight_sync.process_group import join_group
from tandem.toy_model import build_tokenizer
from tests.helpers import free_port
from tests.test_engine_weights import logprob_error, sample

NamedTensors = list[tuple[str, torch.Tensor]]


@pytest.fixture(scope="module")
def odd_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny tied Llama with hidden size 63: norms and MLP weights have odd lengths."""
    out = tmp_path_factory.mktemp("odd") / "model"
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=63,
        head_dim=16,
        intermediate_size=191,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="float32",
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def mixed_weights(model_dir: Path, seed: int) -> NamedTensors:
    """Perturbed weights as a trainer might export them: norms and gate_proj in bfloat16 (odd
    lengths), the rest float32; lm_head.weight (tied) equals the embedding."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=gen))
    out = []
    for name, tensor in model.state_dict().items():
        bf16 = "norm" in name or "gate_proj" in name
        out.append((name, tensor.detach().to(torch.bfloat16 if bf16 else torch.float32).clone()))
    assert any(t.dtype == torch.bfloat16 and t.numel() % 2 for _, t in out)
    return out


def engine_weights(url: str, names: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for name in names:
        reply = httpx.post(
            f"{url}/get_weights_by_name", timeout=30, json={"name": name, "truncate_size": 1 << 20}
        )
        assert reply.status_code == 200, reply.text
        out[name] = torch.tensor(reply.json(), dtype=torch.float32)
    return out


def join(url: str) -> object:
    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(
            httpx.post,
            f"{url}/init_weights_update_group",
            timeout=60,
            json={
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": "weights",
                "backend": "gloo",
            },
        )
        group = join_group("127.0.0.1", port, 0, 2, "weights", "gloo", timedelta(seconds=60))
        assert joined.result().status_code == 200, joined.result().text
    return group


def joined_engine(start_service, model_dir: Path) -> tuple:  # type: ignore[no-untyped-def]
    """A `tandem engine` that advertises Tandem's update extensions, in a weight group with
    this process as rank 0."""
    engine = start_service(
        "engine", ["engine", "--model", str(model_dir), "--port", "0", "--update-timeout-s", "30"]
    )
    info = httpx.get(f"{engine.url}/get_server_info", timeout=10).json()
    assert info["weight_update_bucket_sizes"] is True and info["weight_update_layout_id"] is True
    return engine, join(engine.url)


def update(
    url: str,
    group: object,
    tensors: NamedTensors,
    version: str,
    bucket_sizes: list[int] | None = None,
    layout_id: str | None = None,
    listed: bool = True,
) -> httpx.Response:
    """One request; per-tensor broadcasts, or (with `bucket_sizes`) one flat uint8 broadcast
    per bucket: the tensors' bytes back to back in listed order, no padding. With a
    `layout_id` and not `listed`, the body names the layout instead of listing it."""
    body: dict = {"group_name": "weights", "flush_cache": True, "weight_version": version}
    if listed:
        body |= {
            "names": [n for n, _ in tensors],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors],
        }
    if layout_id is not None:
        body["layout_id"] = layout_id
    if bucket_sizes is not None:
        body["load_format"] = "flattened_bucket"
        if listed:
            body["bucket_sizes"] = bucket_sizes
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(
            httpx.post, f"{url}/update_weights_from_distributed", json=body, timeout=60
        )
        if bucket_sizes is None:
            for _, tensor in tensors:
                dist.broadcast(tensor, src=0, group=group)
        else:
            start = 0
            for size in bucket_sizes:
                bucket = tensors[start : start + size]
                start += size
                flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])
                dist.broadcast(flat, src=0, group=group)
        return reply.result()


def test_flat_buckets_of_mixed_dtypes_give_exactly_the_weights_of_per_tensor_broadcasts(
    start_service, odd_model_dir: Path
) -> None:
    engine, group = joined_engine(start_service, odd_model_dir)
    tensors, other = mixed_weights(odd_model_dir, seed=1), mixed_weights(odd_model_dir, seed=2)
    names = [n for n, _ in tensors]
    sizes = [3, 8, len(tensors) - 11]  # buckets that start and end mid-layer

    reply = update(engine.url, group, tensors, "1", bucket_sizes=sizes)
    assert reply.status_code == 200, reply.text
    assert reply.json()["weight_version"] == "1"
    flat = engine_weights(engine.url, names)
    for name, tensor in tensors:  # bfloat16 values widen exactly to float32
        assert torch.equal(flat[name], tensor.float()), name
    expected = AutoModelForCausalLM.from_pretrained(odd_model_dir).eval()
    expected.load_state_dict({n: t.float() for n, t in tensors})
    after = sample(engine.url)  # the model runs on the adopted views
    assert after["meta_info"]["weight_version"] == "1"
    assert logprob_error(expected, after) < 1e-4

    assert update(engine.url, group, other, "2").status_code == 200
    assert not torch.equal(engine_weights(engine.url, names[:1])[names[0]], flat[names[0]])
    assert update(engine.url, group, tensors, "3").status_code == 200  # per tensor
    per_tensor = engine_weights(engine.url, names)
    assert all(torch.equal(per_tensor[n], flat[n]) for n in names)
    dist.destroy_process_group(group)


def test_bucket_sizes_that_do_not_add_up_are_refused_naming_the_field(
    start_service, toy_model_dir: Path
) -> None:
    engine = start_service("engine", ["engine", "--model", str(toy_model_dir), "--port", "0"])
    config = json.loads((toy_model_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    body = {
        "names": ["model.norm.weight", "model.layers.0.input_layernorm.weight"],
        "dtypes": ["float32", "float32"],
        "shapes": [[hidden], [hidden]],
        "load_format": "flattened_bucket",
        "weight_version": "1",
    }
    url = f"{engine.url}/update_weights_from_distributed"
    for bad in ([1], [1, 2], [2, 0], "2", [1.5, 0.5]):
        reply = httpx.post(url, json={**body, "bucket_sizes": bad}, timeout=30)
        assert reply.status_code == 400, (bad, reply.text)
        assert "bucket_sizes" in reply.text, (bad, reply.text)
    no_format = {k: v for k, v in body.items() if k != "load_format"}
    reply = httpx.post(url, json={**no_format, "bucket_sizes": [2]}, timeout=30)
    assert reply.status_code == 400 and "load_format" in reply.text
    reply = httpx.post(url, json={**body, "load_format": "safetensors"}, timeout=30)
    assert reply.status_code == 400 and "load_format" in reply.text
    assert httpx.get(f"{engine.url}/get_weight_version").json() == {"weight_version": "0"}


def test_a_layout_sent_once_is_named_by_its_id_afterwards_and_an_unknown_id_is_a_409(
    start_service, odd_model_dir: Path
) -> None:
    engine, group = joined_engine(start_service, odd_model_dir)
    first, second = mixed_weights(odd_model_dir, seed=3), mixed_weights(odd_model_dir, seed=4)
    names = [n for n, _ in first]
    sizes = [5, len(first) - 5]

    reply = update(engine.url, group, first, "1", bucket_sizes=sizes, layout_id="llama-a")
    assert reply.status_code == 200, reply.text
    # Versions 2-4 by id alone: the engine alternates between two kept receive sets, never
    # receiving into the one the model runs on.
    for version, tensors in (("2", second), ("3", first), ("4", second)):
        reply = update(engine.url, group, tensors, version, sizes, "llama-a", listed=False)
        assert reply.status_code == 200, reply.text
        got = engine_weights(engine.url, names)
        for name, tensor in tensors:  # the misaligned float32s were copied out too
            assert torch.equal(got[name], tensor.float()), (version, name)
    expected = AutoModelForCausalLM.from_pretrained(odd_model_dir).eval()
    expected.load_state_dict({n: t.float() for n, t in second})
    assert logprob_error(expected, sample(engine.url)) < 1e-4

    # Refused before any collective (this test broadcasts nothing for them): the group and
    # the weights are as they were, and the next full request works.
    body = {
        "layout_id": "llama-b",
        "load_format": "flattened_bucket",
        "group_name": "weights",
        "weight_version": "5",
    }
    url = f"{engine.url}/update_weights_from_distributed"
    reply = httpx.post(url, json=body, timeout=30)
    assert reply.status_code == 409 and "names, dtypes and shapes" in reply.text, reply.text
    per_tensor = {k: v for k, v in body.items() if k != "load_format"} | {"layout_id": "llama-a"}
    reply = httpx.post(url, json=per_tensor, timeout=30)  # llama-a is a flat-bucket layout
    assert reply.status_code == 409 and "load_format" in reply.text, reply.text
    assert httpx.get(f"{engine.url}/get_weight_version").json() == {"weight_version": "4"}
    reply = update(engine.url, group, first, "5", bucket_sizes=sizes, layout_id="llama-b")
    assert reply.status_code == 200, reply.text
    got = engine_weights(engine.url, names)
    assert all(torch.equal(got[n], t.float()) for n, t in first)
    dist.destroy_process_group(group)


def test_kept_receive_sets_alternate_and_the_live_one_is_never_received_into() -> None:
    prepared = PreparedLayout([("model.norm.weight", torch.float32, [4])], [1], problem="")
    made: list[ReceiveSet] = []

    def make() -> ReceiveSet:
        made.append(ReceiveSet([torch.empty(16, dtype=torch.uint8)], [], [], None))
        return made[-1]

    first = prepared.receive_set(None, make)
    second = prepared.receive_set(first, make)  # the model runs on `first`
    assert second is not first
    assert prepared.receive_set(second, make) is first
    assert prepared.receive_set(first, make) is second
    assert prepared.receive_set(None, make) in (first, second)  # e.g. after a load from disk
    assert len(made) == 2
