#!/usr/bin/env bash
# Stage -1 and stage 4's transformers engine at CosyVoice2-0.5B's size on one GPU, with nothing but
# torch and transformers: for a GPU machine that has no vLLM, verl or Ray and cannot install them
# (scripts/gpu_check.sh is the full check, after `bash scripts/install.sh --gpu`). Random weights of
# the released shapes and keys (tests/cosyvoice2_tiny.py write_random_llm, ~2 GB), converted by
# pretrained_to_huggingface.py, then benchmarks/bench_hf_engine.py on the GPU: codes a second by dtype
# and batch size, peak GPU memory, and agreement with the CPU fp32 engine (sampled, and greedy).
# About 10 minutes on one H200, most of it the bf16 runs (docs/gpu.md has that run's numbers).
#   PY=python3 bash scripts/gpu_hf_check.sh          (PYTHONPATH must reach ttsrl: the repo root)
#   GPU_HF_CHECK_DIR=/tmp/x bash scripts/gpu_hf_check.sh   keep the work folder there
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${GPU_HF_CHECK_DIR:-$(mktemp -d /tmp/ttsrl_gpu_hf.XXXXXX)}
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
start=$SECONDS
say() { echo "[gpu_hf_check $((SECONDS - start))s] $*"; }
say "work folder $WORK, python $PY, $(nproc) CPU cores"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__)"
"$PY" -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; from cosyvoice2_tiny import write_random_llm; write_random_llm(Path(sys.argv[1]))" "$WORK/CosyVoice2-0.5B"
say "random CosyVoice2-0.5B llm.pt written"
"$PY" pretrained_to_huggingface.py --pretrained-cosyvoice2-path "$WORK/CosyVoice2-0.5B" --save-path "$WORK/hf_model"
say "stage -1 done"
"$PY" benchmarks/bench_hf_engine.py --model-dir "$WORK/hf_model" --device cuda --dtypes float32,bfloat16 \
  --batch-sizes 1,16,64 --n 64 --compare 8
say "sampled done"
"$PY" benchmarks/bench_hf_engine.py --model-dir "$WORK/hf_model" --device cuda --dtypes float32,bfloat16 \
  --batch-sizes 16 --n 16 --compare 8 --greedy
say "greedy done"
