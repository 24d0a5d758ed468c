#!/usr/bin/env bash
# First contact with a GPU: one command, its phases under 13 minutes of limits on one GPU, that
# prints what works and the numbers (tokens/s, GRPO step time, peak GPU memory), and a summary
# of the phases at the end (exit 1 if one failed or ran out of time; the others still ran).
#   bash scripts/gpu_check.sh            after `bash scripts/install.sh --gpu` (uses .venv/)
#   GPU_CHECK_DIR=/tmp/x bash scripts/gpu_check.sh     keep the work folder there
#   GPU_CHECK_DEVICE=cpu PY=.venv-vllm/bin/python bash scripts/gpu_check.sh   the same on CPU (its
#     full-size rehearsal phase needs ~30 min there: GPU_CHECK_LIMITS="600 300 3600 300", or
#     GPU_CHECK_REHEARSAL="build convert" for a quick pass)
#   bash scripts/gpu_check.sh --family cosyvoice3   (or MODEL_FAMILY=cosyvoice3, run.sh's setting)
#     step 1 adds CosyVoice3's head and rule in vLLM (tests/gpu_stack/test_vllm_cosyvoice3.py) and
#     step 3 rehearses Fun-CosyVoice3-0.5B's shapes (scripts/rehearsal.sh --family cosyvoice3: its
#     reward server and GRPO rewards need TTSRL_COSYVOICE_CHECKOUT, else they are skipped, said so);
#     steps 2 and 4 measure the engine and CosyVoice2's token2wav as without it
# Steps: 1. vLLM loads our converted + merged checkpoints through the plugin; greedy ids and
# per-token log-probs equal the transformers class (tests/gpu_stack/test_vllm_engine.py on
# cuda), sampled draws follow CosyVoice2's rule (tests/gpu_stack/test_vllm_sampling.py); 2. stage-4
# engine throughput (benchmarks/bench_vllm_engine.py); 3. the full-size rehearsal on the GPU
# (scripts/rehearsal.sh: a random CosyVoice2-0.5B-shaped model converted, served by vLLM against
# transformers, the cosyvoice2 reward server, 2 GRPO steps of the GPU preset scaled to one GPU,
# the fp32 merge bit-equal to the FSDP master, stage 4 with vLLM, the export loaded by CosyVoice's
# Qwen2LM); 4. token2wav at full size, serial vs batched flow (benchmarks/bench_token2wav.py).
# Output is also written to $GPU_CHECK_DIR/gpu_check.log.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/family.sh
source scripts/family.sh
family_arg gpu_check.sh "$@"
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

say "work folder $WORK, python $PY, device $DEVICE, family $FAMILY"
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
# set-up (GPU_CHECK_LIMITS="PARITY BENCH REHEARSAL T2W" in seconds overrides them; not yet
# measured on a GPU: the rehearsal's phases took 31 min on 2 CPU cores)
read -r LIMIT_PARITY LIMIT_BENCH LIMIT_GRPO LIMIT_T2W <<< "${GPU_CHECK_LIMITS:-180 90 420 90}"
# token2wav at the released model's flow/HiFT size on a GPU (the tests' tiny one on a CPU, where
# the full size takes ~14 s an utterance)
T2W_SIZE=${GPU_CHECK_T2W_SIZE:-$([[ $DEVICE == cuda ]] && echo full || echo tiny)}
# CosyVoice's code is in the GPU .venv and the CPU .venv, not in the CPU vLLM venv (.venv-vllm)
T2W_PY=$([[ $DEVICE == cuda ]] && echo "$PY" || echo .venv/bin/python)
T2W_BATCHES=$([[ $DEVICE == cuda ]] && echo 1,16 || echo 1,4)
# the family's own vLLM test on top of CosyVoice2's (the plugin serves both)
PARITY_TESTS="tests/gpu_stack/test_vllm_engine.py tests/gpu_stack/test_vllm_sampling.py"
[[ $FAMILY == cosyvoice2 ]] || PARITY_TESTS+=" tests/gpu_stack/test_vllm_$FAMILY.py"
export PY DEVICE WORK T2W_SIZE T2W_PY T2W_BATCHES FAMILY PARITY_TESTS
parity() {
  # shellcheck disable=SC2086  # PARITY_TESTS: paths without spaces, one a word
  TTSRL_TEST_DEVICE=$DEVICE "$PY" -m pytest -q -s -p no:cacheprovider $PARITY_TESTS > "$WORK/parity.log" 2>&1
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
# the rehearsal's phases that ask something of the GPU (its pre-2025 yaml and transformers-engine
# stage 4 are CPU questions, answered by `bash scripts/rehearsal.sh` there)
rehearsal() {
  local vllm_py=$PY  # the GPU stack's python; CosyVoice's code: $T2W_PY
  REHEARSAL_DEVICE=$DEVICE PY=$T2W_PY VLLM_PY=$vllm_py REHEARSAL_DIR=$WORK/rehearsal \
    REHEARSAL_PHASES=${GPU_CHECK_REHEARSAL:-"build convert vllm reward grpo merge stage4_vllm export"} \
    bash scripts/rehearsal.sh --family "$FAMILY" > "$WORK/rehearsal.out" 2>&1
  local rc=$?
  grep -E "^\[phase|^\[rehearsal\] (vLLM|greedy|log-probs|step|merged|reward batch|CosyVoice|ttsrl's|upstream's|speech)|^  " \
    "$WORK/rehearsal.out"
  return $rc
}
t2w() {  # serial vs batched flow: the batched speed-up on a GPU
  set -o pipefail
  "$T2W_PY" benchmarks/bench_token2wav.py --size "$T2W_SIZE" --device "$DEVICE" --batch-sizes "$T2W_BATCHES" 2>&1 \
    | tee "$WORK/token2wav.log" | grep -E "^(model|serial:|serial time|batch )"
}
export -f parity bench rehearsal t2w
phase "1/4 plugin load + parity + the sampling rule in vLLM" "$LIMIT_PARITY" parity
phase "2/4 stage-4 engine throughput" "$LIMIT_BENCH" bench
phase "3/4 full-size rehearsal (GRPO, merge, stage 4, export)" "$LIMIT_GRPO" rehearsal
phase "4/4 token2wav ($T2W_SIZE): serial vs batched flow" "$LIMIT_T2W" t2w

if [[ $DEVICE == cuda ]]; then
  kill "$SMI" 2>/dev/null || true
  say "peak GPU memory used (all processes): $(sort -n "$WORK/gpu_mem.csv" | tail -1) MiB"
fi
say "log: $WORK/gpu_check.log"
phases_summary
