#!/usr/bin/env bash
# The GPU checks and benchmarks behind `make gpu-check` and `make gpu-sinks`, for a CUDA machine, even a bare
# one (torch, triton, transformers, safetensors, grpcio, crc32c; no Ray, Redis or FastAPI).
#
#   benchmarks/gpu_check.sh OUT STEP...     e.g. benchmarks/gpu_check.sh gpu-results engine-gpu gpu-tests
#
# Each step runs under its own time limit and writes its log (and JSON) into OUT, and every step runs even
# when an earlier one failed: a lent GPU is often a one-off, so one crash must not cost the other figures.
# GPU_BUDGET_S (seconds, default none) bounds the whole run: each step's limit is cut to what is left, and a
# step with under 30 s left is not started (named at the end), so the steps given first, the most valuable,
# fit a machine lent for a few minutes. Exits 1 if any step failed or was not started; the last lines name
# them. Steps, in the order worth running them:
#   engine-gpu        benchmarks/engine_gpu.py (issue 12: decode step, roofline, prefill MFU, vs transformers)
#   transfer-gpu      benchmarks/transfer_gpu.py (issue 13: CUDA IPC, gloo and gRPC from device memory)
#   gpu-tests         the `gpu` tests (fp32 parity, compiled kernels, CUDA graphs, device-memory sizing)
#   engine-gpu-async  benchmarks/engine_gpu.py --async-scheduling: the 1.1B shape's decode step, host work hidden
#   engine-gpu-long   2,048-token prompts, the int8 cache against the bf16 one (decode reads mostly KV)
#   speculative-gpu   benchmarks/speculative_gpu.py: a drafted step's cost against a graph-replayed decode step
#   moe-gpu           benchmarks/moe_gpu.py: the fused MoE kernels against the expert loop and the roofline
#   lora-gpu          benchmarks/lora_batch.py on the GPU: a decode batch of 8 adapters against the base model
#   engine-gpu-fp8    benchmarks/engine_gpu.py with --quantization fp8: the 8B shape's decode step on fp8 weights
#   engine-gpu-int4   benchmarks/engine_gpu.py with --int-weights awq: the 8B shape's decode step on 4-bit weights
#   moe-gpu-int4      benchmarks/moe_gpu.py with --weights int4: the fused MoE kernels on 4-bit experts
#   engine-gpu-int8   benchmarks/engine_gpu.py with --int-weights gptq --int-bits 8: the 8B shape on 8-bit weights
#   engine-gpu-w8a8   benchmarks/engine_gpu.py with --int-weights w8a8: the 8B shape's prefill on int8 tensor cores
#   moe-gpu-w8a8      benchmarks/moe_gpu.py with --weights w8a8: the fused MoE kernels on W8A8 experts
#   speculative-gpu-draft  benchmarks/speculative_gpu.py --draft-layers 2: a draft model's drafted step cost
#   sinks-train       benchmarks/train_tiny.py on the GPU with a 65,536-token batch (issue 16)
#   sinks-attention   benchmarks/attention_mass.py on that model: the weight its first tokens get
#   sinks-quality     benchmarks/kv_quality.py on that model: KV formats, window-only vs sinks + window
set -u
if [ $# -lt 2 ]; then
  sed -n '2,/^set -u/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'
  exit 2
fi
out=$1
shift
py=${PY:-python3}
sinks_minutes=${SINKS_MINUTES:-4}
budget=${GPU_BUDGET_S:-0}
export PYTHONPATH=.:proto
mkdir -p "$out"
failed=()

step() {  # step NAME SECONDS COMMAND...: run COMMAND with a time limit, its output also into OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  if [ "$budget" -gt 0 ]; then
    local left=$((budget - SECONDS))
    if [ "$left" -lt 30 ]; then
      echo "== $name: not started, ${left} s of GPU_BUDGET_S=${budget} left"
      failed+=("$name (not started: budget)")
      return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "== $name (limit ${limit} s): $*"
  local start=$SECONDS
  timeout "$limit" "$@" > >(tee "$out/$name.log") 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
}

for name in "$@"; do
  case $name in
    engine-gpu) step "$name" 300 "$py" benchmarks/engine_gpu.py --json "$out/engine_gpu.json" ;;
    transfer-gpu) step "$name" 180 "$py" benchmarks/transfer_gpu.py --json "$out/transfer_gpu.json" ;;
    gpu-tests) step "$name" 420 "$py" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
      tests/test_engine_model.py --junitxml "$out/gpu_tests.xml" ;;
    engine-gpu-async) step "$name" 150 "$py" benchmarks/engine_gpu.py --shapes tinyllama-1.1b --batches 1,64,256 \
      --skip-hf --async-scheduling --json "$out/engine_gpu_async.json" ;;
    engine-gpu-long)
      for kv in auto int8; do
        step "$name-$kv" 180 "$py" benchmarks/engine_gpu.py --shapes tinyllama-1.1b --batches 64,256 \
          --prompt-len 2048 --new-tokens 64 --skip-hf --kv-cache-dtype "$kv" --json "$out/engine_gpu_long_$kv.json"
      done ;;
    speculative-gpu) step "$name" 180 "$py" benchmarks/speculative_gpu.py --json "$out/speculative_gpu.json" ;;
    moe-gpu) step "$name" 120 "$py" benchmarks/moe_gpu.py --json "$out/moe_gpu.json" ;;
    lora-gpu) step "$name" 120 "$py" benchmarks/lora_batch.py --device cuda --dtype bfloat16 --batch 64 \
      --json "$out/lora_gpu.json" ;;
    engine-gpu-fp8) step "$name" 180 "$py" benchmarks/engine_gpu.py --shapes llama-3-8b --batches 1,64 --skip-hf \
      --quantization fp8 --json "$out/engine_gpu_fp8.json" ;;
    engine-gpu-int4) step "$name" 240 "$py" benchmarks/engine_gpu.py --shapes llama-3-8b --batches 1,64 --skip-hf \
      --int-weights awq --json "$out/engine_gpu_int4.json" ;;
    moe-gpu-int4) step "$name" 120 "$py" benchmarks/moe_gpu.py --weights int4 --tokens 1,16,64,256 \
      --json "$out/moe_gpu_int4.json" ;;
    engine-gpu-int8) step "$name" 240 "$py" benchmarks/engine_gpu.py --shapes llama-3-8b --batches 1,64 --skip-hf \
      --int-weights gptq --int-bits 8 --json "$out/engine_gpu_int8.json" ;;
    engine-gpu-w8a8) step "$name" 240 "$py" benchmarks/engine_gpu.py --shapes llama-3-8b --batches 1,64 --skip-hf \
      --int-weights w8a8 --json "$out/engine_gpu_w8a8.json" ;;
    moe-gpu-w8a8) step "$name" 120 "$py" benchmarks/moe_gpu.py --weights w8a8 --tokens 1,16,64,256,2048 \
      --json "$out/moe_gpu_w8a8.json" ;;
    speculative-gpu-draft) step "$name" 180 "$py" benchmarks/speculative_gpu.py --draft-layers 2 \
      --json "$out/speculative_gpu_draft.json" ;;
    sinks-train) step "$name" $((sinks_minutes * 60 + 120)) "$py" benchmarks/train_tiny.py --device cuda \
      --minutes "$sinks_minutes" --tokens-per-step 65536 --lr 0.004 --threads 8 --force \
      --out "$out/trained-stdlib" --json "$out/train_tiny.json" ;;
    sinks-attention) step "$name" 120 "$py" benchmarks/attention_mass.py --model "$out/trained-stdlib" --threads 8 ;;
    sinks-quality) step "$name" 420 "$py" benchmarks/kv_quality.py --model "$out/trained-stdlib" --threads 8 \
      --json "$out/kv_quality.json" ;;
    *) echo "unknown step $name (see: $0 without arguments)" >&2; failed+=("$name (unknown)") ;;
  esac
done

if [ ${#failed[@]} -gt 0 ]; then
  printf 'failed: %s\n' "${failed[@]}"
  exit 1
fi
echo "every step passed; logs and JSON in $out/"
