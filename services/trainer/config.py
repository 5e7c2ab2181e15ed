"""`TrainerConfig`: every choice the trainer makes, one field each (slime's names where the
concept is the same), and the start-up validation of the batch arithmetic."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from proto.contract import RunContract, model_identity
from services.sample_buffer import redis_url_problem


def _f(default, help_text: str, **meta):  # type: ignore[no-untyped-def]
    return field(default=default, metadata={"help": help_text, **meta})


# Each number's range: (lowest, whether the lowest itself is allowed, highest).
RANGES: dict[str, tuple[float, bool, float]] = {
    **dict.fromkeys(("lr", "adam_eps", "eps_clip", "eps_clip_high"), (0.0, False, math.inf)),
    **dict.fromkeys(
        ("min_lr", "weight_decay", "clip_grad", "entropy_coef", "kl_coef", "lr_warmup_iters"),
        (0.0, True, math.inf),
    ),
    **dict.fromkeys(  # (each took -3 without a word)
        ("tis_clip_low", "critic_lr", "value_clip", "moe_aux_loss_coeff"), (0.0, True, math.inf)
    ),
    # (0: a group whose rewards are all equal had 0 / 0 = NaN advantages, its step skipped)
    **dict.fromkeys(("tis_clip", "advantage_eps"), (0.0, False, math.inf)),
    **dict.fromkeys(("adam_beta1", "adam_beta2", "lambd"), (0.0, True, 1.0)),
    "gamma": (0.0, False, 1.0),
    **dict.fromkeys(
        ("num_threads", "micro_batch_size", "max_tokens_per_gpu"), (1.0, True, math.inf)
    ),
    # (0: a read that blocks for good, as Redis reads BLOCK 0; a division by 0; no model)
    **dict.fromkeys(
        ("read_block_ms", "make_vocab_size_divisible_by", "tensor_model_parallel_size"),
        (1.0, True, math.inf),
    ),
}
# Estimators whose baseline is the group's mean reward: a group of one learns nothing.
GROUP_BASELINED = ("grpo", "dr_grpo", "reinforce_plus_plus_baseline")


@dataclass
class TrainerConfig:
    """Configuration of `tandem trainer`."""

    # --- where things are ------------------------------------------------------------------
    model: str = _f("", "Hugging Face model directory (config.json + *.safetensors) to start from.")
    redis_url: str = _f("redis://127.0.0.1:6379/0", "Redis URL of the sample buffer.")
    run_id: str = _f("default", "Run id: key prefix of this run in Redis.")
    weights_endpoint: str = _f(
        "", "ZMQ endpoint of the weight broker's intake (tcp://host:port); empty = do not send."
    )
    weight_transport: str = _f(
        "zmq",
        "How weights leave the trainer: zmq (buckets pushed to the broker) or nccl (the broker "
        "has engines join a weight group and rank 0 broadcasts; gloo when training on CPU). "
        "Must match the broker's --transport.",
        choices=["zmq", "nccl"],
    )
    weights_shm_dir: str = _f(
        "",
        "zmq transport, trainer and engines on one host: write each version into shared-memory "
        "slots in this folder (e.g. /dev/shm); only headers go over ZMQ. Empty = payload in "
        "ZMQ frames.",
    )
    weights_master_address: str = _f(
        "127.0.0.1", "nccl transport: address engines use to reach this trainer's rendezvous."
    )
    consumer: str = _f("trainer-0", "Consumer name in the Redis consumer group.")
    metrics_port: int = _f(
        -1,
        "Serve Prometheus metrics at http://--metrics-host:PORT/metrics (rank 0, a background "
        "thread that never blocks training); 0 = any free port (printed at start), -1 = off. "
        "`tandem up` passes 0.",
    )
    metrics_host: str = _f("127.0.0.1", "Address of the --metrics-port server.")

    # --- batch arithmetic ------------------------------------------------------------------
    rollout_batch_size: int = _f(
        64, "Prompts (groups) per rollout; one rollout feeds num_steps_per_rollout steps."
    )
    n_samples_per_prompt: int = _f(8, "Samples per prompt (the GRPO group size).")
    num_steps_per_rollout: int = _f(
        1, "Optimizer steps per rollout (global batch = rollout samples / this)."
    )
    max_tokens_per_gpu: int = _f(
        8192,
        "Token budget of one packed micro-batch (dynamic batch size); a longer sample is an error.",
    )
    use_dynamic_batch_size: bool = _f(
        True,
        "Pack samples into micro-batches of at most max_tokens_per_gpu tokens (THD); "
        "off = right-padded micro-batches of micro_batch_size samples.",
    )
    micro_batch_size: int = _f(
        64, "Samples per padded micro-batch (only without dynamic batch size)."
    )
    max_steps: int = _f(0, "Stop after this many optimizer steps (0 = run until SIGTERM).")
    max_staleness: int = _f(
        1, "Drop (and count) a group whose weight version is more than this behind the trainer's."
    )
    read_block_ms: int = _f(1000, "How long one Redis read waits for new groups.")
    max_response_len: int = _f(
        32768,
        "Longest response (tokens) the trainer takes; a longer sample's group is moved to the "
        "dead-letter stream (so are samples beyond the model's context or --max-tokens-per-gpu).",
    )
    redis_timeout_s: float = _f(
        120.0, "How long a lost Redis connection is waited for (retrying) before exit 1."
    )
    reclaim_min_idle_s: float = _f(
        60.0,
        "At start, groups another consumer read and left unacked this long (a trainer gone for "
        "good) are claimed and trained by this one.",
    )
    new_lineage: bool = _f(
        False,
        "Start from --model on a run whose Redis already holds trained versions, or from "
        "--ckpt-step N older than its folder's newest checkpoint (without it such a start is "
        "refused): versions go on from the published one, and groups made by the old weights "
        "are dead-lettered.",
    )

    # --- optimizer -------------------------------------------------------------------------
    lr: float = _f(
        1e-6,
        "Peak learning rate (AdamW), 0 to 1. The default suits a pretrained model; `tandem up` passes "
        "1e-3 for its toy model, whose rate would wreck a pretrained one in a few steps.",
    )
    min_lr: float = _f(0.0, "Learning rate at the end of the decay, 0 to 1.")
    lr_decay_style: str = _f(
        "constant", "Schedule after warm-up.", choices=["constant", "linear", "cosine"]
    )
    lr_warmup_iters: int = _f(0, "Linear warm-up steps.")
    lr_decay_iters: int = _f(0, "Steps of decay (0 = max_steps, which then must be > 0 for decay).")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.999, "AdamW beta2.")
    adam_eps: float = _f(1e-8, "AdamW epsilon.")
    clip_grad: float = _f(1.0, "Gradient clipping by global norm (0 = off).")
    seed: int = _f(1234, "Seed of the trainer's RNGs.")

    # --- advantages and loss ---------------------------------------------------------------
    advantage_estimator: str = _f(
        "grpo",
        "How rewards become advantages.",
        choices=["grpo", "dr_grpo", "reinforce_plus_plus_baseline", "reinforce_plus_plus", "gae"],
    )
    normalize_advantage_std: bool = _f(
        True, "GRPO: divide by the group's reward std (off = Dr.GRPO style mean-only)."
    )
    advantage_eps: float = _f(1e-6, "Added to the std before dividing.")
    eps_clip: float = _f(0.2, "PPO clip: ratio lower bound is 1 - eps_clip.")
    eps_clip_high: float = _f(0.2, "PPO clip-higher: ratio upper bound is 1 + eps_clip_high.")
    eps_clip_c: float = _f(
        0.0, "Dual-clip constant c (> 1 enables dual clip for negative advantages)."
    )
    policy_loss_type: str = _f(
        "ppo",
        "ppo = token-level ratios; gspo = sequence-level (geometric mean) ratios.",
        choices=["ppo", "gspo"],
    )
    loss_aggregation: str = _f(
        "token_mean",
        "token_mean over all tokens of the step, or seq_mean_token_mean (mean per "
        "sample, then over samples), or seq_mean_token_sum_norm (Dr.GRPO: sum / max length).",
        choices=["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"],
    )
    entropy_coef: float = _f(0.0, "Entropy bonus coefficient (loss -= coef * entropy).")
    kl_coef: float = _f(0.0, "KL-to-reference coefficient in the loss (needs --ref-load).")
    kl_loss_type: str = _f(
        "low_var_kl",
        "KL estimator: k1, k2 or k3 (= low_var_kl).",
        choices=["k1", "k2", "k3", "low_var_kl"],
    )
    use_kl_loss: bool = _f(True, "KL as a loss term (on) or as a reward penalty (off).")
    ref_load: str = _f("", "HF directory of the frozen reference model for KL (empty = none).")
    use_tis: bool = _f(
        False,
        "Truncated importance sampling: weight token losses by "
        "min(pi_trainer_old / pi_engine, tis_clip).",
    )
    tis_clip: float = _f(
        2.0,
        "Upper bound of the importance weight (TIS, and decoupled PPO's proximal/behaviour weight).",
    )
    tis_clip_low: float = _f(0.0, "Lower bound of the TIS weight.")
    decoupled_ppo: bool = _f(
        False,
        "Decoupled PPO: clip against the trainer's recomputed (proximal) log-probs and "
        "weight by proximal/behaviour (engine) importance ratio; off = clip against the engine's.",
    )
    recompute_logprobs: str = _f(
        "auto",
        "The trainer's log-probs before the update (decoupled PPO's proximal policy, the "
        "engine/trainer mismatch and entropy metrics) from a separate forward pass: always, or "
        "auto = only where they are needed before the loss (KL as a reward penalty); otherwise "
        "the training forward's own log-probs, detached, are the same values and save a pass.",
        choices=["auto", "always"],
    )
    critic_lr: float = _f(
        0.0, "Critic learning rate for --advantage-estimator gae, 0 to 1 (0 = --lr)."
    )
    value_clip: float = _f(0.2, "PPO value clipping around the critic's pre-step values (0 = off).")
    gamma: float = _f(1.0, "Discount for REINFORCE++ returns and GAE.")
    lambd: float = _f(1.0, "GAE lambda.")
    on_nonfinite: str = _f(
        "skip",
        "NaN/Inf loss or gradient: skip the update (and count it) or fail.",
        choices=["skip", "fail"],
    )
    max_skipped_in_a_row: int = _f(
        3,
        "End the run with exit code 1 after this many consecutive skipped (non-finite) "
        "updates (0 = never for a streak; a run whose every update was skipped exits 1 anyway).",
    )

    # --- model / parallelism ---------------------------------------------------------------
    tensor_model_parallel_size: int = _f(1, "Tensor-parallel size (torchrun world = TP x DP).")
    expert_model_parallel_size: int = _f(
        1, "MoE models: experts split over this many data-parallel ranks (needs TP = 1)."
    )
    use_routing_replay: bool = _f(
        False,
        "MoE models: route each token to the experts the engine chose for it (samples carry "
        "them when the router runs with --return-routed-experts); off = the trainer's own routing.",
    )
    moe_aux_loss_coeff: float = _f(
        0.0, "MoE models: coefficient of the router's load-balancing loss (0 = off)."
    )
    moe_grouped_experts: bool = _f(
        True,
        "MoE models: run all local experts as grouped GEMMs (torch._grouped_mm); "
        "false = megatron's SequentialMLP, one expert after another.",
    )
    make_vocab_size_divisible_by: int = _f(128, "Pad the vocabulary to a multiple of this x TP.")
    bf16: bool = _f(False, "Train in bf16 (fp32 master weights); default fp32.")
    num_threads: int = _f(1, "torch.set_num_threads for this process.")

    # --- checkpoints -----------------------------------------------------------------------
    save: str = _f("", "Directory for megatron dist checkpoints (empty = never save).")
    save_interval: int = _f(0, "Save every N steps (0 = only at exit when --save is set).")
    load: str = _f(
        "",
        "Resume from this checkpoint directory (latest_checkpointed_iteration.txt). Without it, "
        "a --save directory that holds a checkpoint is resumed from.",
    )
    ckpt_step: int = _f(
        -1, "Iteration to load (-1 = the tracker's latest; an older one needs --new-lineage)."
    )
    resume: bool = _f(
        True,
        "Resume from the checkpoint --save already holds (when --load is not given); "
        "--no-resume starts from --model even so (refused when that checkpoint belongs to "
        "another --run-id: its tracker would be overwritten).",
    )
    override_opt_param_scheduler: bool = _f(
        False,
        "On resume, --lr, --min-lr, --lr-decay-style, --lr-warmup-iters and --lr-decay-iters "
        "replace the checkpoint's schedule (without it the checkpoint's values win).",
    )
    keep_last_checkpoints: int = _f(
        0, "Keep only the newest K iter_* directories under --save (0 = keep all)."
    )
    save_hf: str = _f(
        "",
        "Write the trained model as a Hugging Face directory (config.json, model.safetensors or "
        "5 GB shards with their index, the tokenizer files of --model) here at each checkpoint and at exit (empty = never).",
    )

    def validate(self, dp_size: int = 1) -> None:
        """Raise ValueError with what to change when the numbers do not fit together."""
        if not self.model:
            raise ValueError("--model is required (a Hugging Face model directory)")
        if problem := self.range_problem():
            raise ValueError(problem)
        if self.weight_transport == "nccl" and self.weights_endpoint:
            from services.weight_sync.wire import check_weight_bind

            check_weight_bind("--weights-master-address", self.weights_master_address)
        for name in ("rollout_batch_size", "n_samples_per_prompt", "num_steps_per_rollout"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.n_samples_per_prompt == 1 and self.advantage_estimator in GROUP_BASELINED:
            raise ValueError(
                f"--n-samples-per-prompt 1 with --advantage-estimator {self.advantage_estimator}"
                ": each sample is its group's only one, its advantage (reward minus the group's "
                "mean) is 0, and nothing is learned: use 2 or more samples a prompt, or "
                "--advantage-estimator reinforce_plus_plus (or gae)"
            )
        if self.save_interval < 0 or self.keep_last_checkpoints < 0:
            raise ValueError("--save-interval and --keep-last-checkpoints must be >= 0")
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        if samples % self.num_steps_per_rollout:
            raise ValueError(
                f"one rollout has rollout_batch_size x n_samples_per_prompt = {samples} samples, "
                f"which --num-steps-per-rollout {self.num_steps_per_rollout} does not divide"
            )
        gbs = samples // self.num_steps_per_rollout
        if gbs % dp_size:
            raise ValueError(
                f"global batch {gbs} samples does not divide by data-parallel size {dp_size}: "
                "change --rollout-batch-size, --n-samples-per-prompt or the number of processes"
            )
        if not self.use_dynamic_batch_size and (gbs // dp_size) % self.micro_batch_size:
            raise ValueError(
                f"per-rank batch {gbs // dp_size} samples does not divide by --micro-batch-size "
                f"{self.micro_batch_size}"
            )
        if self.lr_decay_style != "constant" and max(self.lr_decay_iters, self.max_steps) < 1:
            raise ValueError("--lr-decay-style needs --lr-decay-iters or --max-steps >= 1")
        if self.kl_coef and not self.ref_load:
            raise ValueError("--kl-coef > 0 needs --ref-load (the frozen reference model)")
        if self.advantage_estimator == "gae" and self.tensor_model_parallel_size != 1:
            raise ValueError(
                "--advantage-estimator gae (critic) needs --tensor-model-parallel-size 1"
            )
        if self.expert_model_parallel_size < 1:
            raise ValueError("--expert-model-parallel-size must be >= 1")
        if self.expert_model_parallel_size > 1 and (
            not self.use_dynamic_batch_size
            or self.tensor_model_parallel_size > 1
            or self.advantage_estimator == "gae"
        ):
            # the ranks' micro-batches are equalized for the expert dispatcher (packed only)
            raise ValueError(
                "--expert-model-parallel-size > 1 needs --use-dynamic-batch-size, "
                "--tensor-model-parallel-size 1 and no critic (--advantage-estimator gae)"
            )
        if problem := redis_url_problem(self.redis_url):
            raise ValueError(problem)
        if self.max_response_len < 1 or self.redis_timeout_s <= 0 or self.reclaim_min_idle_s < 0:
            raise ValueError(
                "--max-response-len and --redis-timeout-s must be > 0, --reclaim-min-idle-s >= 0"
            )
        if self.eps_clip_c and self.eps_clip_c <= 1.0:
            raise ValueError("--eps-clip-c must be > 1 (or 0 to disable dual clip)")

    def range_problem(self) -> str:
        """The first number outside its range (`RANGES`), as 'flag must be ...: got value'
        ("" if none)."""
        for name, (low, closed, high) in RANGES.items():
            value = getattr(self, name)
            if not ((value >= low if closed else value > low) and value <= high):
                above = f"{'>=' if closed else '>'} {low:g}"
                within = f" and <= {high:g}" if high < math.inf else ""
                return f"--{name.replace('_', '-')} must be {above}{within}: got {value}"
        return ""

    def run_contract(self) -> RunContract:
        """The run's terms as this trainer states them (see proto/contract.py)."""
        return RunContract(
            model_id=model_identity(self.model),
            rollout_batch_size=self.rollout_batch_size,
            n_samples_per_prompt=self.n_samples_per_prompt,
            num_steps_per_rollout=self.num_steps_per_rollout,
            max_staleness=self.max_staleness,
            weight_transport=self.weight_transport,
        )

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step."""
        return self.rollout_batch_size * self.n_samples_per_prompt // self.num_steps_per_rollout
