"""The model: a Hugging Face checkpoint (`proto.models`) run with our own batched KV cache.

`transformers` loads the checkpoint and provides every layer module; this file only drives them
(the same modules, the same order of operations as the Hugging Face forward) so that rows can
join and leave a running batch, which Hugging Face's own cache does not allow. Prefill takes
right-padded prompts; decode appends one token per row at that row's own position.

Knows nothing about requests, sampling or HTTP. Not thread-safe: one caller (the scheduler's
generation thread) at a time; weight loads are serialized with generation by the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from proto.models import check_model_dir
from services.common.tokenizers import load_tokenizer

Score = tuple[int, float]  # (first prompt position to score, temperature)

# Prompts longer than this are prefilled one at a time (see `prefill_all`).
PREFILL_ALONE_TOKENS = 256

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightError(ValueError):
    """A weight update names an unknown parameter or carries a wrong shape; nothing was changed."""


@dataclass
class KVCache:
    """Keys and values of the running rows, per layer `[rows, kv_heads, capacity, head_dim]`,
    `lengths[r]`: how many positions of row r are filled, and for MoE models `routes`: the
    experts each MoE layer chose at each filled position, `[rows, moe_layers, capacity, top_k]`
    (int16), kept with the keys so that every path a row takes (prompt cache, retraction,
    joining a batch) keeps its routing beside its keys."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: torch.Tensor
    routes: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.keys[0].shape[2]) if self.keys else 0

    def select(self, rows: torch.Tensor) -> KVCache:
        """The cache of `rows` only (a copy), in that order; a row may repeat."""
        return KVCache(
            [k.index_select(0, rows) for k in self.keys],
            [v.index_select(0, rows) for v in self.values],
            self.lengths.index_select(0, rows),
            None if self.routes is None else self.routes.index_select(0, rows),
        )

    def row(self, index: int) -> KVCache:
        """A copy of one row, trimmed to its length."""
        n = int(self.lengths[index])
        return KVCache(
            [k[index : index + 1, :, :n].clone() for k in self.keys],
            [v[index : index + 1, :, :n].clone() for v in self.values],
            self.lengths[index : index + 1].clone(),
            None if self.routes is None else self.routes[index : index + 1, :, :n].clone(),
        )

    def grow(self, capacity: int) -> None:
        """Make room for `capacity` positions per row (doubling, to amortize the copies)."""
        if capacity <= self.capacity:
            return
        new_cap = max(capacity, 2 * self.capacity)
        self.keys = [_pad_capacity(k, new_cap) for k in self.keys]
        self.values = [_pad_capacity(v, new_cap) for v in self.values]
        if self.routes is not None:
            self.routes = _pad_capacity(self.routes, new_cap)

    def routed_experts(self, index: int) -> torch.Tensor | None:
        """Row `index`'s expert choices `[positions, moe_layers, top_k]` (None: dense model)."""
        if self.routes is None:
            return None
        return self.routes[index, :, : int(self.lengths[index])].transpose(0, 1).cpu()

    @staticmethod
    def concat(caches: Sequence[KVCache]) -> KVCache:
        caches = [c for c in caches if c.rows]
        if len(caches) == 1:
            return caches[0]
        cap = max(c.capacity for c in caches)
        layers = range(len(caches[0].keys))
        routes = None
        if caches[0].routes is not None:
            routes = torch.cat([_pad_capacity(c.routes, cap) for c in caches])  # type: ignore[arg-type]
        return KVCache(
            [torch.cat([_pad_capacity(c.keys[i], cap) for c in caches]) for i in layers],
            [torch.cat([_pad_capacity(c.values[i], cap) for c in caches]) for i in layers],
            torch.cat([c.lengths for c in caches]),
            routes,
        )


# A prefill's next-token logits, cache and prompt-token logprobs (see `ModelRunner.prefill`)
Prefilled = tuple[torch.Tensor, KVCache, list[list[float | None] | None]]


def merge_prefilled(
    parts: Sequence[Prefilled], order: list[int], device: torch.device
) -> Prefilled:
    """Prefill results of parts of a batch as one, rows back in input order (`order`: the
    input index of each row of the parts, concatenated)."""
    back = sorted(range(len(order)), key=order.__getitem__)
    index = torch.tensor(back, device=device)
    scores = [s for p in parts for s in p[2]]
    logits = torch.cat([p[0] for p in parts]).index_select(0, index)
    return logits, KVCache.concat([p[1] for p in parts]).select(index), [scores[i] for i in back]


def _pad_capacity(t: torch.Tensor, capacity: int) -> torch.Tensor:
    if t.shape[2] >= capacity:
        return t
    out = t.new_zeros((t.shape[0], t.shape[1], capacity, t.shape[3]))
    out[:, :, : t.shape[2]] = t
    return out


class ModelRunner:
    """Owns the model and tokenizer; runs prefill and decode forwards over a `KVCache`."""

    def __init__(
        self,
        model_path: str,
        tokenizer_path: str,
        device: str,
        dtype: str,
        load_format: str = "auto",
    ) -> None:
        # Only architectures whose forward is exactly the one `_layers` runs (pre-norm decoder,
        # rotary embeddings, optional q/k norms, a dense or MoE MLP module): others (e.g.
        # Gemma's scaled embeddings) would differ silently.
        check_model_dir(model_path)
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch sees no CUDA device")
        if dtype == "auto":
            dtype = "float32" if device == "cpu" else "bfloat16"
        # pin the index: worker threads start on device 0 and must set this one explicitly
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if device == "cuda"
            else torch.device(device)
        )
        self.dtype = DTYPES[dtype]
        flag = "--tokenizer" if tokenizer_path else "--model"
        self.tokenizer = load_tokenizer(tokenizer_path or model_path, flag)
        # A second instance for the generation thread (stop strings): a fast tokenizer must not
        # be used from two threads at once, and HTTP handlers use `tokenizer` concurrently.
        self.stop_tokenizer = load_tokenizer(tokenizer_path or model_path, flag)
        self.model = self._load(model_path, load_format == "dummy")
        # Looked up on every weight update (a state_dict() of a large model costs milliseconds).
        # Updates change a parameter's `.data`, never the Parameter object or its shape.
        self._params = dict(self.model.named_parameters())
        self._aliases = _expert_aliases(self.model)
        # MoE experts are updated through `_aliases` (per-expert names) only
        fused = {n for n in self._params if n.endswith((".gate_up_proj", ".experts.down_proj"))}
        for name in fused:
            del self._params[name]
        self._shapes = {
            name: tuple(t.shape) for name, t in self.model.state_dict().items() if name not in fused
        }
        self._shapes.update({name: tuple(t.shape) for name, t in self._aliases.items()})
        self.config = self.model.config
        inner = self.model.model
        self.embed, self.layers, self.norm = inner.embed_tokens, inner.layers, inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = self.model.lm_head
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.num_kv_heads = self.config.num_key_value_heads
        self.qk_norm = hasattr(attn, "q_norm")
        self.eos_token_ids = self._eos_ids()
        self.max_position = int(getattr(self.config, "max_position_embeddings", 4096))
        window = getattr(self.config, "sliding_window", None)
        if window and getattr(self.config, "use_sliding_window", True):
            # within the window, sliding-window attention is full attention: stay inside it
            self.max_position = min(self.max_position, int(window))

    def _load(self, path: str, dummy: bool) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        if dummy:  # random init, directly on the device: nothing read, no host round trip
            config = AutoConfig.from_pretrained(path)
            with self.device:
                model = AutoModelForCausalLM.from_config(
                    config, dtype=self.dtype, attn_implementation="sdpa"
                )
        else:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=self.dtype, attn_implementation="sdpa"
            )
        model.to(self.device).eval().requires_grad_(False)
        return model

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.config, "eos_token_id", None)):
            gen = getattr(self.model, "generation_config", None)
            for value in (source, getattr(gen, "eos_token_id", None)):
                if isinstance(value, int):
                    ids.add(value)
                elif isinstance(value, (list, tuple)):
                    ids.update(int(v) for v in value)
        return ids

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes one position of one row takes (keys and values, every layer)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return len(self.layers) * 2 * self.num_kv_heads * self.head_dim * element

    def bind_thread(self) -> None:
        """Make this model's device current in the calling thread (CUDA's is per thread)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.weight.shape[0])

    # ---- forward passes -------------------------------------------------------------------

    def _layers(self, hidden: torch.Tensor, positions: torch.Tensor, attend):  # type: ignore[no-untyped-def]
        """(final hidden states, the experts each MoE layer chose `[batch, moe_layers, steps,
        top_k]` int16, or None for a dense model)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        cos, sin = self.rotary(hidden, positions)
        batch, steps, _ = hidden.shape
        routes: list[torch.Tensor] = []
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(batch, steps, -1, self.head_dim)
            k = attn.k_proj(x).view(batch, steps, -1, self.head_dim)
            v = attn.v_proj(x).view(batch, steps, -1, self.head_dim).transpose(1, 2)
            if self.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            out = attend(index, q, k, v).transpose(1, 2).reshape(batch, steps, -1)
            hidden = hidden + attn.o_proj(out)
            hidden = hidden + self._mlp(layer.mlp, layer.post_attention_layernorm(hidden), routes)
        chosen = torch.stack(routes, 1).to(torch.int16) if routes else None
        return self.norm(hidden), chosen

    @staticmethod
    def _mlp(mlp: torch.nn.Module, x: torch.Tensor, routes: list[torch.Tensor]) -> torch.Tensor:
        """A dense MLP, or transformers' own MoE block driven step by step (its router `gate`,
        then its `experts`, as its forward does) so that the chosen experts are recorded."""
        if not hasattr(mlp, "experts"):
            return mlp(x)
        batch, steps, width = x.shape
        flat = x.reshape(-1, width)
        _logits, weights, chosen = mlp.gate(flat)
        routes.append(chosen.view(batch, steps, -1))
        return mlp.experts(flat, chosen, weights).view(batch, steps, width)

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        # no mask = plain causal attention, which lets torch pick a kernel that never
        # materializes the [rows, heads, steps, steps] score matrix
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scaling,
            enable_gqa=k.shape[1] != q.shape[1],
        )

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def prefill_all(
        self, prompts: Sequence[Sequence[int]], score: Sequence[Score | None] | None = None
    ) -> Prefilled:
        """`prefill` in input order, with each long prompt run alone: a padded batch needs an
        explicit mask, whose attention scores grow with the square of the longest prompt."""
        score = list(score or [None] * len(prompts))
        long = [i for i, p in enumerate(prompts) if len(p) > PREFILL_ALONE_TOKENS]
        if not long or len(prompts) == 1:
            return self.prefill(prompts, score)
        short = [i for i, p in enumerate(prompts) if len(p) <= PREFILL_ALONE_TOKENS]
        batches = ([short] if short else []) + [[i] for i in long]
        parts = [self.prefill([prompts[i] for i in b], [score[i] for i in b]) for b in batches]
        return merge_prefilled(parts, [i for batch in batches for i in batch], self.device)

    @torch.inference_mode()
    def prefill(
        self, prompts: Sequence[Sequence[int]], score: Sequence[Score | None] | None = None
    ) -> Prefilled:
        """Run whole prompts; return the next-token logits `[rows, vocab]` (fp32), their cache
        and, for rows with a `score` (start, temperature), the logprob of each prompt token from
        `start` on under `log_softmax(logits / temperature)` (None for the first token)."""
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        steps = int(lengths.max())
        ids = torch.zeros((len(prompts), steps), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.as_tensor(prompt, dtype=torch.long)
        ids, lengths_dev = ids.to(self.device), lengths.to(self.device)
        arange = torch.arange(steps, device=self.device)
        positions = arange.expand(len(prompts), steps)
        mask: torch.Tensor | None = None
        if int(lengths.min()) != steps:
            # query i sees key j when j <= i and j is a real prompt token of that row
            mask = (arange[None, :] <= arange[:, None])[None] & (
                arange[None, None, :] < lengths_dev[:, None, None]
            )
            mask = mask[:, None]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []

        def attend(_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys.append(k)
            values.append(v)
            return self._sdpa(q, k, v, mask)

        hidden, routes = self._layers(self.embed(ids), positions, attend)
        last = hidden[torch.arange(len(prompts), device=self.device), lengths_dev - 1]
        scores = [
            None if sc is None else self._score(hidden[row], prompts[row], *sc)
            for row, sc in enumerate(score or [None] * len(prompts))
        ]
        return self._logits(last), KVCache(keys, values, lengths_dev, routes), scores

    def _score(
        self, hidden: torch.Tensor, prompt: Sequence[int], start: int, temperature: float
    ) -> list[float | None]:
        first = max(start, 1)
        if first >= len(prompt):
            return [None] * (len(prompt) - start)
        logits = self._logits(hidden[first - 1 : len(prompt) - 1]) / temperature
        targets = torch.as_tensor(prompt[first:], device=logits.device)
        values = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0].tolist()
        return [None] * (first - start) + values

    @torch.inference_mode()
    def decode(self, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
        """Append `tokens[r]` to row r of `cache` (in place); return next-token logits (fp32)."""
        positions = cache.lengths
        cache.grow(int(positions.max()) + 1)
        rows = torch.arange(cache.rows, device=self.device)
        span = int(positions.max()) + 1
        mask = (torch.arange(span, device=self.device)[None, :] <= positions[:, None])[
            :, None, None
        ]

        def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.keys[index][rows, :, positions] = k[:, :, 0]
            cache.values[index][rows, :, positions] = v[:, :, 0]
            return self._sdpa(
                q, cache.keys[index][:, :, :span], cache.values[index][:, :, :span], mask
            )

        hidden, routes = self._layers(
            self.embed(tokens.to(self.device)[:, None]), positions[:, None], attend
        )
        if routes is not None and cache.routes is not None:
            cache.routes[rows, :, positions] = routes[:, :, 0]
        cache.lengths = positions + 1
        return self._logits(hidden[:, 0])

    # ---- weights --------------------------------------------------------------------------

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every state_dict entry (parameters, tied aliases, buffers), by HF
        checkpoint name: an MoE layer's experts under their per-expert names (see
        `_expert_aliases`), as SGLang's loaders take them."""
        return self._shapes

    def check_weights(self, named: Iterable[tuple[str, Sequence[int]]]) -> None:
        """Raise `WeightError` if any name is unknown or any shape differs (checks all first)."""
        shapes = self.parameter_shapes()
        problems = []
        for name, shape in named:
            if name not in shapes:
                problems.append(f"unknown parameter {name!r}")
            elif tuple(shape) != shapes[name]:
                problems.append(f"{name!r} has shape {list(shape)}, model has {list(shapes[name])}")
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise WeightError("; ".join(problems[:3]) + more)

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], adopt: bool = False) -> int:
        """Put already-checked tensors into the model; returns how many (see `plan_load`)."""
        return self.apply_load(self.plan_load(named, adopt))

    def plan_load(self, named: Iterable[tuple[str, torch.Tensor]], adopt: bool) -> LoadPlan:
        """What `apply_load` will do, decided from metadata only (the tensors' data may still
        be arriving). With `adopt`, a tensor that is a parameter's own (on its device, with
        its dtype, contiguous) becomes that parameter's storage instead of being copied; the
        rest is copied in: a tied name such as `lm_head.weight` of a tied model (not a
        parameter of its own), a buffer, or a tensor of another dtype or device."""
        plan = LoadPlan()
        for name, tensor in named:
            param = self._params.get(name) if adopt else None
            if param is not None and _same_layout(tensor, param):
                plan.adopt.append((param, tensor))
            else:
                plan.copy.append((name, tensor))
        return plan

    @torch.inference_mode()
    def apply_load(self, plan: LoadPlan) -> int:
        """Carry out a `plan_load` plan (generation must not run meanwhile); returns the
        number of tensors loaded."""
        for param, tensor in plan.adopt:
            param.data = tensor
        for name, tensor in plan.copy:  # after adopting: a tied alias now sees the new storage
            target = self._tensor(name)
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        return len(plan.adopt) + len(plan.copy)

    def _tensor(self, name: str) -> torch.Tensor:
        """The model's current tensor under a state_dict name (a parameter, a tied alias such
        as `lm_head.weight`, or a buffer)."""
        if name in self._aliases:
            return self._aliases[name]
        module_name, _, attr = name.rpartition(".")
        return getattr(self.model.get_submodule(module_name), attr)

    def can_adopt(self, named: list[tuple[str, torch.Tensor]]) -> bool:
        """Whether `named` can replace the parameters' storage: it names every parameter,
        each already on our device with our dtype and contiguous."""
        given = {name: tensor for name, tensor in named}
        return set(self._params) <= set(given) and all(
            _same_layout(given[n], p) for n, p in self._params.items()
        )


@dataclass
class LoadPlan:
    """Tensors to become parameters' storage, and tensors to copy in (by state_dict name)."""

    adopt: list[tuple[torch.nn.Parameter, torch.Tensor]] = field(default_factory=list)
    copy: list[tuple[str, torch.Tensor]] = field(default_factory=list)


def _same_layout(tensor: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether `tensor` can serve as `param`'s storage as it is."""
    return tensor.device == param.device and tensor.dtype == param.dtype and tensor.is_contiguous()


def _expert_aliases(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF checkpoint names of each expert's projections -> views of transformers' fused
    expert tensors (`experts.gate_up_proj` `[E, 2 * I, H]` = per expert `[gate; up]`,
    `experts.down_proj` `[E, H, I]`), so weight updates speak the checkpoint's (and SGLang's)
    per-expert names: `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`."""
    aliases: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        gate_up = getattr(module, "gate_up_proj", None)
        down = getattr(module, "down_proj", None)
        if not name.endswith("mlp.experts") or not isinstance(gate_up, torch.Tensor):
            continue
        assert isinstance(down, torch.Tensor)
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            aliases[f"{name}.{e}.gate_proj.weight"] = gate_up.data[e, :inter]
            aliases[f"{name}.{e}.up_proj.weight"] = gate_up.data[e, inter:]
            aliases[f"{name}.{e}.down_proj.weight"] = down.data[e]
    return aliases
