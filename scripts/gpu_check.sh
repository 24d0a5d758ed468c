#!/usr/bin/env bash
# First contact with a GPU: one command, its phases under 13 minutes of limits on one GPU, that
# prints what works and the numbers (tokens/s, GRPO step time, peak GPU memory), and a summary
# of the phases at the end (exit 1 if one failed or ran out of time; the others still ran).
#   bash scripts/gpu_check.sh            after `bash scripts/install.sh --gpu` (uses .venv/)
#   GPU_CHECK_DIR=/tmp/x bash scripts/gpu_check.sh     keep the work folder there
#   GPU_CHECK_DEVICE=cpu PY=.venv-vllm/bin/python bash scripts/gpu_check.sh   the same on CPU
# Steps: 1. vLLM loads our converted + merged checkpoints through the plugin; greedy ids and
# per-token log-probs equal the transformers class (tests/gpu_stack/test_vllm_engine.py on
# cuda), sampled draws follow CosyVoice2's rule (tests/gpu_stack/test_vllm_sampling.py); 2. stage-4 engine throughput (benchmarks/bench_vllm_engine.py); 3. GRPO, the GPU
# preset scaled to one GPU, 3 steps on a tiny model, merge, stage 4 with vLLM
# (scripts/gpu_check.py). Output is also written to $GPU_CHECK_DIR/gpu_check.log.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
WORK=${GPU_CHECK_DIR:-$(mktemp -d /tmp/ttsrl_gpu_check.XXXXXX)}
mkdir -p "$WORK"
exec > >(tee "$WORK/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# shellcheck source=scripts/phases.sh
source scripts/phases.sh
start=$SECONDS
say() { echo "[gpu_check $((SECONDS - start))s] $*"; }

say "work folder $WORK, python $PY, device $DEVICE"
"$PY" - <<'PY'
import importlib.metadata as m, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "| vllm", m.version("vllm"), "| transformers",
      m.version("transformers"), "| verl", m.version("verl"))
print("GPUs:", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
assert any(e.name == "ttsrl_cosyvoice2" for e in m.entry_points(group="vllm.general_plugins")), "ttsrl not installed"
PY
if [[ $DEVICE == cuda ]]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  # peak GPU memory over all processes (actor, vLLM, reward server), sampled every 0.5 s
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$WORK/gpu_mem.csv" &
  SMI=$!
  trap 'kill $SMI 2>/dev/null || true' EXIT
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
fi
"$PY" -c "import pytest" 2>/dev/null || "$PY" -m pip install -q pytest

# each phase under its own limit (cold vLLM compile and CUDA graphs take minutes); a failed or
# timed-out phase is recorded and the next one runs, so one run answers what it can; the limits
# sum to 13 min, leaving the rest of a 15-minute GPU lease for start-up and this script's own
# set-up (GPU_CHECK_LIMITS="PARITY BENCH GRPO" in seconds overrides them; not yet measured on a GPU)
read -r LIMIT_PARITY LIMIT_BENCH LIMIT_GRPO <<< "${GPU_CHECK_LIMITS:-240 150 390}"
export PY DEVICE WORK
parity() {
  TTSRL_TEST_DEVICE=$DEVICE "$PY" -m pytest -q -s -p no:cacheprovider \
    tests/gpu_stack/test_vllm_engine.py tests/gpu_stack/test_vllm_sampling.py > "$WORK/parity.log" 2>&1
  local rc=$?
  grep -oE "\[(start|merged)\] [^(]*|\[draws\] vLLM.*| [0-9]+ (passed|failed).*" "$WORK/parity.log"
  (( rc == 0 )) || tail -60 "$WORK/parity.log"
  return $rc
}
bench() {
  set -o pipefail
  "$PY" benchmarks/bench_vllm_engine.py --device "$DEVICE" 2>&1 | tee "$WORK/bench.log" \
    | grep -E "tokens/s|engine start|identical|peak"
}
grpo() { "$PY" scripts/gpu_check.py --device "$DEVICE" --workdir "$WORK/run"; }
export -f parity bench grpo
phase "1/3 plugin load + parity + the sampling rule in vLLM" "$LIMIT_PARITY" parity
phase "2/3 stage-4 engine throughput" "$LIMIT_BENCH" bench
phase "3/3 GRPO (GPU preset, 1 GPU, tiny model) + merge + stage 4" "$LIMIT_GRPO" grpo

if [[ $DEVICE == cuda ]]; then
  kill "$SMI" 2>/dev/null || true
  say "peak GPU memory used (all processes): $(sort -n "$WORK/gpu_mem.csv" | tail -1) MiB"
fi
say "log: $WORK/gpu_check.log"
phases_summary
