"""`TrainerConfig`: every choice the trainer makes, in sections (slime's names where the concept
is the same): the run's shared terms (`run`), the batch intake, optimizer, loss, model,
checkpoints and weights. Ranges are in the field types; `validate` checks the arithmetic across
fields; `check` the start-up checks that read files (the model, the checkpoint folders)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from proto.run_terms import RunTerms
from services.common.settings import Count, Positive, PositiveSeconds, Seconds, Section, unless
from services.sample_buffer import SampleBuffer, redis_url_problem
from services.trainer.ckpt_folder import TRACKER, check_files, resolve_iteration, saved_iteration

NonNegative = Annotated[float, Field(ge=0)]
Above0 = Annotated[float, Field(gt=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]
# Estimators whose baseline is the group's mean reward: a group of one learns nothing.
GROUP_BASELINED = ("grpo", "dr_grpo", "reinforce_plus_plus_baseline")


class BatchSection(Section):
    """How groups are read from the buffer and packed into micro-batches."""

    max_tokens_per_gpu: Positive = 8192
    """Token budget of one packed micro-batch (dynamic batch size); a longer sample is an error."""
    use_dynamic_batch_size: bool = True
    """Pack samples into micro-batches of at most max_tokens_per_gpu tokens (THD); off =
    right-padded micro-batches of micro_batch_size samples."""
    micro_batch_size: Positive = 64
    """Samples per padded micro-batch (only without dynamic batch size)."""
    max_steps: Count = 0
    """Stop after this many optimizer steps (0 = run until SIGTERM)."""
    read_block_ms: Positive = 1000
    """How long one Redis read waits for new groups."""
    max_response_len: Positive = 32768
    """Longest response (tokens) the trainer takes; a longer sample's group is moved to the
    dead-letter stream (so are samples beyond the model's context or --max-tokens-per-gpu)."""
    redis_timeout_s: PositiveSeconds = 120.0
    """How long a lost Redis connection is waited for (retrying) before exit 1."""
    reclaim_min_idle_s: Seconds = 60.0
    """At start, groups another consumer read and left unacked this long (a trainer gone for
    good) are claimed and trained by this one."""
    consumer: str = "trainer-0"
    """Consumer name in the Redis consumer group."""


class OptimizerSection(Section):
    """AdamW and its learning-rate schedule."""

    lr: Annotated[float, Field(gt=0, le=1)] = 1e-6
    """Peak learning rate (AdamW), 0 to 1. The default suits a pretrained model; `tandem up`
    passes 1e-3 for its toy model, whose rate would wreck a pretrained one in a few steps."""
    min_lr: Fraction = 0.0
    """Learning rate at the end of the decay, 0 to 1."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after warm-up."""
    lr_warmup_iters: Count = 0
    """Linear warm-up steps."""
    lr_decay_iters: Count = 0
    """Steps of decay (0 = max_steps, which then must be > 0 for decay)."""
    weight_decay: NonNegative = 0.0
    """AdamW weight decay."""
    adam_beta1: Fraction = 0.9
    """AdamW beta1."""
    adam_beta2: Fraction = 0.999
    """AdamW beta2."""
    adam_eps: Above0 = 1e-8
    """AdamW epsilon."""
    clip_grad: NonNegative = 1.0
    """Gradient clipping by global norm (0 = off)."""
    critic_lr: Fraction = 0.0
    """Critic learning rate for --advantage-estimator gae, 0 to 1 (0 = --lr)."""


# The optimizer settings a checkpoint holds (its schedulers' state: the learning-rates' schedule
# and weight decay; its optimizer's parameter groups: AdamW's betas and epsilon), which a start
# from it keeps unless --override-opt-param-scheduler; saved by name as `scheduler_config`.
SAVED_OPTIMIZER = tuple(name for name in OptimizerSection.model_fields if name != "clip_grad")


def saved_optimizer(path: Path) -> dict[str, object]:
    """SAVED_OPTIMIZER's values checkpoint `path` recorded (an older one's: fewer, or none)."""
    import torch

    common = torch.load(path / "common.pt", map_location="cpu", weights_only=True)
    return dict(common.get("scheduler_config") or {})


class LossSection(Section):
    """Advantages and the policy (and critic) loss."""

    advantage_estimator: Literal[
        "grpo", "dr_grpo", "reinforce_plus_plus_baseline", "reinforce_plus_plus", "gae"
    ] = "grpo"
    """How rewards become advantages."""
    normalize_advantage_std: bool = True
    """GRPO: divide by the group's reward std (off = Dr.GRPO style mean-only)."""
    # (0: a group whose rewards are all equal had 0 / 0 = NaN advantages, its step skipped)
    advantage_eps: Above0 = 1e-6
    """Added to the std before dividing."""
    eps_clip: Above0 = 0.2
    """PPO clip: ratio lower bound is 1 - eps_clip."""
    eps_clip_high: Above0 = 0.2
    """PPO clip-higher: ratio upper bound is 1 + eps_clip_high."""
    eps_clip_c: Annotated[float, Field(ge=0), unless(0, "off", 1, above=True)] = 0.0
    """Dual-clip constant c (> 1 enables dual clip for negative advantages; 0 = off)."""
    policy_loss_type: Literal["ppo", "gspo"] = "ppo"
    """ppo = token-level ratios; gspo = sequence-level (geometric mean) ratios."""
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = (
        "token_mean"
    )
    """token_mean over all tokens of the step, or seq_mean_token_mean (mean per sample, then
    over samples), or seq_mean_token_sum_norm (Dr.GRPO: sum / max length)."""
    entropy_coef: NonNegative = 0.0
    """Entropy bonus coefficient (loss -= coef * entropy)."""
    kl_coef: NonNegative = 0.0
    """KL-to-reference coefficient in the loss (needs --ref-load)."""
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    """KL estimator: k1, k2 or k3 (= low_var_kl)."""
    use_kl_loss: bool = True
    """KL as a loss term (on) or as a reward penalty (off)."""
    ref_load: str = ""
    """HF directory of the frozen reference model for KL (empty = none)."""
    use_tis: bool = False
    """Truncated importance sampling: weight token losses by min(pi_trainer_old / pi_engine,
    tis_clip)."""
    tis_clip: Above0 = 2.0
    """Upper bound of the importance weight (TIS, and decoupled PPO's proximal/behaviour
    weight)."""
    tis_clip_low: NonNegative = 0.0
    """Lower bound of the TIS weight."""
    decoupled_ppo: bool = False
    """Decoupled PPO: clip against the trainer's recomputed (proximal) log-probs and weight by
    proximal/behaviour (engine) importance ratio; off = clip against the engine's."""
    recompute_logprobs: Literal["auto", "always"] = "auto"
    """The trainer's log-probs before the update (decoupled PPO's proximal policy, the
    engine/trainer mismatch and entropy metrics) from a separate forward pass: always, or auto =
    only where they are needed before the loss (KL as a reward penalty); otherwise the training
    forward's own log-probs, detached, are the same values and save a pass."""
    value_clip: NonNegative = 0.2
    """PPO value clipping around the critic's pre-step values (0 = off)."""
    gamma: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Discount for REINFORCE++ returns and GAE."""
    lambd: Fraction = 1.0
    """GAE lambda."""
    on_nonfinite: Literal["skip", "fail"] = "skip"
    """NaN/Inf loss or gradient: skip the update (and count it) or fail."""
    max_skipped_in_a_row: Count = 3
    """End the run with exit code 1 after this many consecutive skipped (non-finite) updates
    (0 = never for a streak; a run whose every update was skipped exits 1 anyway)."""


class ModelSection(Section):
    """Parallelism, precision and MoE choices of the trained model."""

    tensor_model_parallel_size: Positive = 1
    """Tensor-parallel size (torchrun world = TP x DP)."""
    expert_model_parallel_size: Positive = 1
    """MoE models: experts split over this many data-parallel ranks (needs TP = 1)."""
    use_routing_replay: bool = False
    """MoE models: route each token to the experts the engine chose for it (samples carry them
    when the router runs with --return-routed-experts); off = the trainer's own routing."""
    moe_aux_loss_coeff: NonNegative = 0.0
    """MoE models: coefficient of the router's load-balancing loss (0 = off)."""
    moe_grouped_experts: bool = True
    """MoE models: run all local experts as grouped GEMMs (torch._grouped_mm); false =
    megatron's SequentialMLP, one expert after another."""
    make_vocab_size_divisible_by: Positive = 128
    """Pad the vocabulary to a multiple of this x TP."""
    bf16: bool = False
    """Train in bf16 (fp32 master weights); default fp32."""
    num_threads: Positive = 1
    """torch.set_num_threads for this process."""


class CheckpointSection(Section):
    """Where checkpoints are saved and what a start resumes from."""

    save: str = ""
    """Directory for megatron dist checkpoints (empty = never save)."""
    save_interval: Count = 0
    """Save every N steps (0 = only at exit when --save is set)."""
    load: str = ""
    """Resume from this checkpoint directory (latest_checkpointed_iteration.txt). Without it, a
    --save directory that holds a checkpoint is resumed from."""
    ckpt_step: Annotated[int, Field(ge=-1)] = -1
    """Iteration to load (-1 = the tracker's latest; an older one needs --new-lineage)."""
    resume: bool = True
    """Resume from the checkpoint --save already holds (when --load is not given); --no-resume
    starts from --model even so (refused when that checkpoint belongs to another --run-id: its
    tracker would be overwritten)."""
    override_opt_param_scheduler: bool = False
    """On resume, --lr, --min-lr, --lr-decay-style, --lr-warmup-iters, --lr-decay-iters,
    --weight-decay, --adam-beta1, --adam-beta2, --adam-eps and --critic-lr replace the
    checkpoint's (without it the checkpoint's values win; tandem up sets it when one of them is
    given)."""
    keep_last_checkpoints: Count = 0
    """Keep only the newest K iter_* directories under --save (0 = keep all)."""
    save_hf: str = ""
    """Write the trained model as a Hugging Face directory (config.json, model.safetensors or
    5 GB shards with their index, the tokenizer files of --model) here at each checkpoint and at
    exit (empty = never)."""
    new_lineage: bool = False
    """Start from --model on a run whose Redis already holds trained versions, or from
    --ckpt-step N older than its folder's newest checkpoint (without it such a start is
    refused): versions go on from the published one, and groups made by the old weights are
    dead-lettered."""


class WeightsSection(Section):
    """Where each new weight version goes (the transport itself is a run term)."""

    weights_endpoint: str = ""
    """ZMQ endpoint of the weight broker's intake (tcp://host:port); empty = do not send."""
    weights_shm_dir: str = ""
    """zmq transport, trainer and engines on one host: write each version into shared-memory
    slots in this folder (e.g. /dev/shm); only headers go over ZMQ. Empty = payload in ZMQ
    frames."""
    weights_master_address: str = "127.0.0.1"
    """nccl transport: address engines use to reach this trainer's rendezvous."""


class TrainerConfig(Section):
    """Configuration of `tandem trainer`."""

    run: RunTerms = RunTerms()
    batch: BatchSection = BatchSection()
    optimizer: OptimizerSection = OptimizerSection()
    loss: LossSection = LossSection()
    model: ModelSection = ModelSection()
    checkpoint: CheckpointSection = CheckpointSection()
    weights: WeightsSection = WeightsSection()
    metrics_port: Annotated[int, Field(ge=-1)] = -1
    """Serve Prometheus metrics at http://--metrics-host:PORT/metrics (rank 0, a background
    thread that never blocks training); 0 = any free port (printed at start), -1 = off. `tandem
    up` passes 0."""
    metrics_host: str = "127.0.0.1"
    """Address of the --metrics-port server."""
    ready_file: str = ""
    """Write {pid, version, metrics_url} as JSON here once training starts."""

    def validate(self, dp_size: int = 1) -> None:  # type: ignore[override]
        """Raise ValueError with what to change when the settings do not fit together."""
        if not self.run.model:
            raise ValueError("--model is required (a Hugging Face model directory)")
        if self.run.weight_transport == "nccl" and self.weights.weights_endpoint:
            from services.weight_sync.wire import check_weight_bind

            check_weight_bind("--weights-master-address", self.weights.weights_master_address)
        if problem := redis_url_problem(self.run.redis_url) or self._batch_problem(dp_size):
            raise ValueError(problem)
        loss, model = self.loss, self.model
        if self.run.n_samples_per_prompt == 1 and loss.advantage_estimator in GROUP_BASELINED:
            raise ValueError(
                f"--n-samples-per-prompt 1 with --advantage-estimator {loss.advantage_estimator}"
                ": each sample is its group's only one, its advantage (reward minus the group's "
                "mean) is 0, and nothing is learned: use 2 or more samples a prompt, or "
                "--advantage-estimator reinforce_plus_plus (or gae)"
            )
        decays = max(self.optimizer.lr_decay_iters, self.batch.max_steps)
        if self.optimizer.lr_decay_style != "constant" and decays < 1:
            raise ValueError("--lr-decay-style needs --lr-decay-iters or --max-steps >= 1")
        if loss.kl_coef and not loss.ref_load:
            raise ValueError("--kl-coef > 0 needs --ref-load (the frozen reference model)")
        if loss.advantage_estimator == "gae" and model.tensor_model_parallel_size != 1:
            raise ValueError(
                "--advantage-estimator gae (critic) needs --tensor-model-parallel-size 1"
            )
        if model.expert_model_parallel_size > 1 and (
            not self.batch.use_dynamic_batch_size
            or model.tensor_model_parallel_size > 1
            or loss.advantage_estimator == "gae"
        ):
            # the ranks' micro-batches are equalized for the expert dispatcher (packed only)
            raise ValueError(
                "--expert-model-parallel-size > 1 needs --use-dynamic-batch-size, "
                "--tensor-model-parallel-size 1 and no critic (--advantage-estimator gae)"
            )

    def _batch_problem(self, dp_size: int) -> str:
        """Why the batch terms do not divide into steps, ranks and micro-batches ("" if they do)."""
        run = self.run
        samples = run.rollout_batch_size * run.n_samples_per_prompt
        if samples % run.num_steps_per_rollout:
            return (
                f"one rollout has rollout_batch_size x n_samples_per_prompt = {samples} samples, "
                f"which --num-steps-per-rollout {run.num_steps_per_rollout} does not divide"
            )
        gbs = samples // run.num_steps_per_rollout
        if gbs % dp_size:
            return (
                f"global batch {gbs} samples does not divide by data-parallel size {dp_size}: "
                "change --rollout-batch-size, --n-samples-per-prompt or the number of processes"
            )
        micro = self.batch.micro_batch_size
        if not self.batch.use_dynamic_batch_size and (gbs // dp_size) % micro:
            return f"per-rank batch {gbs // dp_size} samples does not divide by --micro-batch-size {micro}"
        return ""

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step."""
        return self.run.global_batch_size


def check(config: TrainerConfig) -> list[str]:
    """The start-up checks that read files, each problem naming the flag to fix: the model is
    one the trainer supports (and fits --max-tokens-per-gpu's window), --ref-load's vocabulary
    is the model's, --save and --save-hf's folder are writable, --load holds the asked
    iteration. (Imports stay inside: `tandem up` imports this module.)"""
    from services.common.paths import unwritable

    ckpt, problems = config.checkpoint, []
    hf_parent = str(Path(ckpt.save_hf).parent) if ckpt.save_hf else ""
    for path, flag in ((ckpt.save, "--save"), (hf_parent, f"--save-hf {ckpt.save_hf}: its folder")):
        if path and (problem := unwritable(path, flag)):
            problems.append(problem)
    try:
        problems += [problem] if (problem := model_problem(config)) else []
        if ckpt.load:  # a bad --load is named before Redis is asked anything
            resolve_iteration(ckpt.load, ckpt.ckpt_step)
    except (ValueError, OSError) as exc:
        problems.append(str(exc))
    return problems


def model_problem(config: TrainerConfig) -> str:
    """Why --model is one this trainer refuses ("" when none): unsupported, an MoE model under
    tensor parallelism, a sliding window the samples may exceed, a --ref-load of another
    vocabulary. Read before importing torch."""
    from proto.models import MOE_MODEL_TYPES, check_model_config, check_sliding_window, read_config
    from services.common.tokenizers import vocabulary_problem

    hf_cfg, path = read_config(config.run.model)
    moe = check_model_config(hf_cfg, path) in MOE_MODEL_TYPES
    if moe and config.model.tensor_model_parallel_size > 1:
        return (
            f"{path}: an MoE model trains at --tensor-model-parallel-size 1 (megatron-core's MoE "
            "layer needs sequence parallelism under TP, which the trainer does not use); split "
            "the experts with --expert-model-parallel-size instead"
        )
    context = int(hf_cfg.get("max_position_embeddings", 4096))
    if config.batch.use_dynamic_batch_size:  # a sample longer than a micro-batch is refused anyway
        context = min(context, config.batch.max_tokens_per_gpu)
    check_sliding_window(hf_cfg, path, context, "--max-tokens-per-gpu (dynamic batch size)")
    ref = config.loss.ref_load
    return vocabulary_problem(config.run.model, ref, "--ref-load") if ref else ""


def finds_checkpoint(cfg: TrainerConfig) -> bool:
    """Whether this start resumes from a checkpoint (as `checkpoint.find_resume` decides)."""
    return bool(cfg.checkpoint.load) or bool(
        cfg.checkpoint.save
        and cfg.checkpoint.resume
        and (Path(cfg.checkpoint.save) / TRACKER).is_file()
    )


def rollback(cfg: TrainerConfig) -> tuple[int, int] | None:
    """(K, L) when this start resumes from checkpoint K (--ckpt-step) of a folder whose newest
    is L > K: the groups steps K+1..L trained were acknowledged at L's save and are gone, so the
    run cannot replay them; None otherwise."""
    root = cfg.checkpoint.load or (cfg.checkpoint.save if cfg.checkpoint.resume else "")
    newest = saved_iteration(root) if root else None
    if cfg.checkpoint.ckpt_step < 0 or newest is None or newest <= cfg.checkpoint.ckpt_step:
        return None
    return cfg.checkpoint.ckpt_step, newest


def lineage_start(cfg: TrainerConfig, buffer: SampleBuffer, resumed: bool) -> int:
    """The version this start begins at: 0 (a fresh run, or a resume that goes on where its
    checkpoint left off), or with --new-lineage the published one + 1. Raises ValueError for a
    start without checkpoint on a trained run, and for a resume of a trained run from a
    checkpoint older than its folder's newest (`rollback`), unless --new-lineage. (A new run
    may start from any checkpoint: nothing of it was acknowledged yet.)"""
    published = buffer.get_version("trainer", 0)
    trained = int(buffer.redis.hlen(buffer.trained_key))
    if resumed and (published > 0 or trained) and (back := rollback(cfg)):  # (on this run)
        if not cfg.checkpoint.new_lineage:
            raise ValueError(
                f"--ckpt-step {back[0]} goes back past this run's newest checkpoint (iteration "
                f"{back[1]} in {cfg.checkpoint.load or cfg.checkpoint.save}): the groups of the steps after "
                f"{back[0]} were acknowledged at that save and are gone, so the run cannot "
                f"train them again. Pass --new-lineage as well to go on from iteration "
                f"{back[0]}'s weights as a new lineage (versions after {max(published, back[1])}"
                "; groups made by the newer weights are dead-lettered), or leave --ckpt-step "
                "out to resume from the newest"
            )
        return max(published, back[1]) + 1
    if resumed or (published <= 0 and not trained):
        return 0
    if not cfg.checkpoint.new_lineage:
        raise ValueError(
            f"run {cfg.run.run_id!r} in Redis ({cfg.run.redis_url}) already has trainer version "
            f"{published} and {trained} trained steps, but no checkpoint was found (--save "
            f"{cfg.checkpoint.save or '(none)'}, --load {cfg.checkpoint.load or '(none)'}): point --save/--load at "
            "this run's checkpoint folder to resume, or use a new --run-id (or an empty Redis), "
            "or pass --new-lineage to start over from --model in this run"
        )
    return published + 1


def check_start(cfg: TrainerConfig, buffer: SampleBuffer) -> int:
    """What this start would refuse once its model is built: a lineage refusal (`lineage_start`),
    the checkpoint it resumes from cut short (`checkpoint.check_files`). tandem up runs it
    before the engines start (they take minutes to load a real model). Returns the version a
    new lineage starts at (0: none, or on from the checkpoint)."""
    resumed = finds_checkpoint(cfg)
    version = lineage_start(cfg, buffer, resumed)
    if resumed:
        ckpt = cfg.checkpoint
        check_files(resolve_iteration(ckpt.load or ckpt.save, ckpt.ckpt_step))
    return version
