"""Start-up checks of the router's configuration that read more than its flags: the buffer's
depth bound against the trainer's rollout, the response bound against the model's context."""

from __future__ import annotations

from proto.models import read_config

DEFAULT_DEPTH_BATCHES = 4  # --max-buffer-depth -1: room for the trainer's rollout and 3 more


def check_buffer_depth(depth: int, batch: int) -> None:
    """The trainer trains on `batch` groups at once: a bound below that would stall the run
    (producers wait for the trainer, the trainer for a full rollout)."""
    if 0 < depth < batch:
        raise ValueError(
            f"--max-buffer-depth {depth} is below the rollout batch size {batch}: the trainer "
            f"needs {batch} groups in the buffer to train, so the run would stall; raise "
            f"--max-buffer-depth to at least {batch} (-1 = {DEFAULT_DEPTH_BATCHES} batches, "
            "0 = unbounded)"
        )


def check_response_len(model: str, length: int) -> None:
    """A response bound at or above the model's context (max_new_tokens was cut at the
    context, and the run said 'up to N tokens')."""
    cfg, path = read_config(model)
    context = int(cfg.get("max_position_embeddings") or 0)
    if context and length >= context:
        raise ValueError(
            f"--rollout-max-response-len {length}: the model's context is {context} "
            f"positions (max_position_embeddings, {path}), prompt and response "
            f"together: give less than {context} (0 = the task's default, cut to fit)"
        )
