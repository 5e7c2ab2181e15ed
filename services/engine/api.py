"""SGLang's `/generate` request and response shapes, translated to and from scheduler jobs.

Knows the JSON field names and their SGLang semantics; knows nothing about HTTP or threads.
Field sources (SGLang v0.5 `io_struct.GenerateReqInput`, `tokenizer_manager`): `text` xor
`input_ids` (a list of them = a batch), `sampling_params` (one object, or one per prompt),
`rid` (str, or one per prompt), `return_logprob`, `logprob_start_len`, `top_logprobs_num`,
`return_text_in_logprobs`, `stream`, `return_routed_experts` with `routed_experts_start_len`
(MoE models: `meta_info.routed_experts` = base64 of int32 `[positions, moe_layers, top_k]`, the
experts chosen at positions `[routed_experts_start_len, prompt + output - 1)`, as
`sglang.srt.state_capturer.routed_experts.extract_routed_experts_from_meta_info` decodes it).
A batch or `n > 1` answers a flat list, prompt-major.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.engine.sampling import RequestError, SamplingParams, derive_seed
from services.engine.scheduler import Job, Sequence, new_rid

# Fields of SGLang's GenerateReqInput that we implement.
IMPLEMENTED_FIELDS = {
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "return_logprob",
    "stream",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "return_prompt_token_ids",
    "return_routed_experts",
    "routed_experts_start_len",
}
# Fields that would change what is generated or returned: refused unless unset/false.
UNSUPPORTED_FIELDS = {
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "token_ids_logprob",
    "return_hidden_states",
    "return_sampling_mask",
    "session_params",
    "lora_path",
    "lora_id",
    "custom_logit_processor",
    "return_entropy",
    "return_indexer_topk",
    "return_bytes",
    "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs",
}
# SGLang fields accepted and ignored: routing hints, logging, bookkeeping (output unchanged).
IGNORED_FIELDS = {
    "log_metrics",
    "modalities",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
    "data_parallel_rank",
    "routed_dp_rank",
    "disagg_prefill_dp_rank",
    "priority",
    "background",
    "extra_key",
    "routing_key",
    "conversation_id",
    "no_logs",
    "custom_labels",
    "external_trace_header",
    "session_id",
    "mm_hashes",
    "mm_content_hashes",
    "use_audio_in_video",
    "video_config",
    "watermark",
    "sampling_logprobs_mode",
    "require_reasoning",
    "max_thinking_tokens",
    "http_worker_ipc",
    "positional_embed_overrides",
}


@dataclass
class GenerateInput:
    """A parsed `/generate` body: one entry per prompt in `prompts`, `params`, `rids`."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    rids: list[str]
    batch: bool
    return_logprob: bool
    text_in_logprobs: bool
    stream: bool
    top_logprobs_num: int = 0
    return_prompt_token_ids: bool = False
    logprob_start_len: int = -1
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0

    @property
    def flat_list(self) -> bool:
        """SGLang answers a list when the input was a batch or asked for n > 1."""
        return self.batch or any(p.n > 1 for p in self.params)


def parse_generate(
    body: Any, tokenizer: Any, vocab_size: int, context_length: int
) -> GenerateInput:
    """Validate a `/generate` body; raise `RequestError` naming the offending field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    # Other top-level fields are ignored, as SGLang does (sglang-router adds `model`, for one).
    for name in UNSUPPORTED_FIELDS:
        if body.get(name):
            raise RequestError(f"{name} is not supported by the reference engine")
    top_n = body.get("top_logprobs_num") or 0
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
        raise RequestError(f"top_logprobs_num must be a non-negative integer, got {top_n!r}")
    prompts, batch = _prompts(body, tokenizer, vocab_size)
    raw_params = body.get("sampling_params") or {}
    if isinstance(raw_params, list):
        if len(raw_params) != len(prompts):
            raise RequestError(
                f"sampling_params has {len(raw_params)} entries for {len(prompts)} prompts"
            )
    else:
        raw_params = [raw_params] * len(prompts)
    params = [SamplingParams.from_json(p) for p in raw_params]
    given = [isinstance(p, dict) and p.get("max_new_tokens") is not None for p in raw_params]
    for prompt, p, explicit in zip(prompts, params, given, strict=True):
        _check_context(prompt, p, explicit, context_length)
    rids = _rids(body.get("rid"), len(prompts), batch)
    start = body.get("logprob_start_len")
    start = -1 if start is None else start
    if not isinstance(start, int) or isinstance(start, bool) or start < -1:
        raise RequestError(f"logprob_start_len must be an integer >= -1, got {start!r}")
    routed_start = body.get("routed_experts_start_len") or 0
    for prompt in prompts:
        if start > len(prompt):
            raise RequestError(
                f"logprob_start_len={start} is higher than the number of input tokens {len(prompt)}"
            )
        if not isinstance(routed_start, int) or not 0 <= routed_start <= len(prompt):
            raise RequestError(
                f"routed_experts_start_len must be in [0, {len(prompt)}], got {routed_start!r}"
            )
    return GenerateInput(
        prompts=prompts,
        params=params,
        rids=rids,
        batch=batch,
        return_logprob=_flag(body, "return_logprob"),
        text_in_logprobs=_flag(body, "return_text_in_logprobs"),
        stream=_flag(body, "stream"),
        top_logprobs_num=min(top_n, vocab_size),
        logprob_start_len=start,
        return_prompt_token_ids=_flag(body, "return_prompt_token_ids"),
        return_routed_experts=_flag(body, "return_routed_experts"),
        routed_experts_start_len=routed_start,
    )


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}")
    return value


def _prompts(body: dict, tokenizer: Any, vocab_size: int) -> tuple[list[list[int]], bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("give exactly one of text or input_ids")
    if text is not None:
        if isinstance(text, str):
            return [tokenizer.encode(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [tokenizer.encode(t) for t in text], True
        raise RequestError("text must be a string or a non-empty list of strings")
    if isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids):
        prompts, batch = ids, True
    else:
        prompts, batch = [ids], False
    for prompt in prompts:
        if not isinstance(prompt, list) or not prompt:
            raise RequestError(
                "input_ids must be a non-empty list of token ids (or a list of them)"
            )
        for token in prompt:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
                raise RequestError(
                    f"input_ids contains {token!r}, not a token id in [0, {vocab_size})"
                )
    return prompts, batch


def _check_context(prompt: list[int], params: SamplingParams, explicit: bool, context: int) -> None:
    # SGLang refuses a prompt that fills the context, and an explicit max_new_tokens that would
    # overflow it; an absent max_new_tokens is clipped at the context instead.
    if len(prompt) >= context:
        raise RequestError(
            f"The input ({len(prompt)} tokens) is longer than the model's context length "
            f"({context} tokens)."
        )
    if explicit and len(prompt) + params.max_new_tokens > context:
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of {context} "
            f"tokens. You requested a total of {len(prompt) + params.max_new_tokens} tokens: "
            f"{len(prompt)} tokens from the input messages and {params.max_new_tokens} tokens "
            "for the completion (sampling_params.max_new_tokens). Please reduce the number of "
            "tokens in the input messages or the completion to fit within the limit."
        )


def _rids(rid: Any, count: int, batch: bool) -> list[str]:
    if rid is None:
        return [new_rid() for _ in range(count)]
    if isinstance(rid, str) and not batch:
        return [rid]
    if isinstance(rid, list) and len(rid) == count and all(isinstance(r, str) for r in rid):
        return rid
    raise RequestError("rid must be a string (one prompt) or a list of strings, one per prompt")


def make_jobs(inp: GenerateInput, notify: Callable[[Job, bool], None]) -> list[Job]:
    """One job per prompt with its `n` sequences; sample i of n seeds from (sampling_seed, i)."""
    jobs = []
    for prompt, params, rid in zip(inp.prompts, inp.params, inp.rids, strict=True):
        job = Job(rid=rid, sequences=[], notify=notify, stream=inp.stream)
        for i in range(params.n):
            seq_id = rid if params.n == 1 else f"{rid}-{i}"
            seed = derive_seed(params.sampling_seed, i)
            seq = Sequence(seq_id, prompt, params, seed, job)
            seq.top_logprobs_num = inp.top_logprobs_num if inp.return_logprob else 0
            if inp.return_logprob and inp.logprob_start_len >= 0:
                seq.input_logprob_start = inp.logprob_start_len
            seq.return_routed_experts = inp.return_routed_experts
            job.sequences.append(seq)
        jobs.append(job)
    return jobs


def sequence_json(seq: Sequence, inp: GenerateInput, tokenizer: Any, done: bool = True) -> dict:
    """One SGLang result: `text`, `output_ids`, `meta_info` (cumulative if still running)."""
    count = min(len(seq.output_ids), len(seq.logprobs))
    output_ids = seq.output_ids[:count]
    reason = seq.finish_reason if done else None
    meta: dict[str, Any] = {
        "id": seq.id,
        "finish_reason": reason,
        "prompt_tokens": len(seq.prompt),
        "completion_tokens": count,
        "cached_tokens": seq.cached_tokens,
        "reasoning_tokens": 0,
        "num_retractions": seq.retractions,
        "weight_version": str(seq.weight_version),
        "e2e_latency": time.monotonic() - seq.job.created_s,
    }
    if inp.return_logprob:
        text = _token_text(tokenizer, inp.text_in_logprobs)
        scored = seq.prompt[inp.logprob_start_len :] if seq.input_logprobs is not None else []
        meta["input_token_logprobs"] = [
            [lp, tok, text(tok)] for lp, tok in zip(seq.input_logprobs or [], scored, strict=True)
        ]
        meta["output_token_logprobs"] = [
            [lp, tok, text(tok)] for lp, tok in zip(seq.logprobs[:count], output_ids, strict=True)
        ]
        meta["output_token_logprobs_length"] = count
        if inp.top_logprobs_num:
            meta["input_top_logprobs"] = []
            meta["output_top_logprobs"] = [
                [[lp, tok, text(tok)] for lp, tok in step] for step in seq.top_logprobs[:count]
            ]
    if inp.return_routed_experts and done and seq.routed_experts is not None:
        chosen = seq.routed_experts[inp.routed_experts_start_len :].to(torch.int32)
        meta["routed_experts"] = base64.b64encode(chosen.numpy().tobytes()).decode()
    result = {
        "text": output_text(seq, output_ids, tokenizer, reason),
        "output_ids": output_ids,
        "meta_info": meta,
    }
    if inp.return_prompt_token_ids:
        result["prompt_token_ids"] = seq.prompt
    return result


def _token_text(tokenizer: Any, enabled: bool) -> Callable[[int], str | None]:
    if not enabled:
        return lambda _token: None
    return lambda token: tokenizer.decode([token])


def output_text(seq: Sequence, output_ids: list[int], tokenizer: Any, reason: dict | None) -> str:
    """Decoded output, cut at a matched stop string as SGLang does: before it, or with
    `no_stop_trim` right after it (the last token may decode past the string's end). A matched
    stop token is dropped unless `no_stop_trim`."""
    params = seq.params
    matched = (reason or {}).get("matched")
    if isinstance(matched, int) and not params.no_stop_trim and output_ids:
        output_ids = output_ids[:-1]
    text = tokenizer.decode(output_ids, skip_special_tokens=params.skip_special_tokens)
    if isinstance(matched, str) and matched in text:
        pos = text.find(matched)
        text = text[: pos + len(matched)] if params.no_stop_trim else text[:pos]
    return text


def response_json(jobs: list[Job], inp: GenerateInput, tokenizer: Any) -> Any:
    results = [sequence_json(s, inp, tokenizer) for job in jobs for s in job.sequences]
    return results if inp.flat_list else results[0]
