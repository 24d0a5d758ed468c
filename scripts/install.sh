#!/usr/bin/env bash
# Stage -2: create .venv/ at the repo root and install ttsrl into it.
#   bash scripts/install.sh          CPU stack (laptop, CI): torch CPU + verl 0.9.1 + speech libs
#   bash scripts/install.sh --gpu    GPU stack of an 8-GPU node (requirements.txt)
# Idempotent: a second run with unchanged requirement files does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=cpu
[[ "${1:-}" == "--gpu" ]] && MODE=gpu
PY=${PYTHON:-python3}
VENV=$ROOT/.venv
STAMP=$VENV/.ttsrl-install-$MODE
want=$(cat requirements*.txt constraints-cpu.txt pyproject.toml | sha256sum | cut -c1-16)

if [[ -f $STAMP && "$(cat "$STAMP")" == "$want" ]]; then
  echo "[install] .venv is up to date ($MODE)"
  exit 0
fi

# Optional system packages: espeak-ng renders audio for the Whisper backend on CPU.
if ! command -v espeak-ng >/dev/null 2>&1; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "[install] apt-get install espeak-ng"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng >/dev/null) \
      || echo "[install] warning: espeak-ng could not be installed; Whisper audio tests will skip"
  else
    echo "[install] note: espeak-ng not found (sudo apt-get install espeak-ng) — only the Whisper-on-CPU path needs it"
  fi
fi

[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
if [[ $MODE == gpu ]]; then
  "${PIP[@]}" install -r requirements.txt
else
  # torch first, CPU build, so that nothing pulls a CUDA build. TTSRL_TORCH_INDEX may name
  # PyTorch's CPU wheel index on machines whose pip does not already find a CPU wheel.
  "${PIP[@]}" install -q "torch==2.13.0" ${TTSRL_TORCH_INDEX:+--index-url "$TTSRL_TORCH_INDEX"}
  "${PIP[@]}" install -q -r requirements-cpu.txt -c constraints-cpu.txt
  # CosyVoice's own runtime for the token2wav tests, without its pins (see the file's header).
  "${PIP[@]}" install -q --no-deps -r requirements-cosyvoice-cpu.txt
  # torchaudio 2.11's compiled ops are built for torch 2.11 and fail to load beside torch 2.13;
  # CosyVoice uses only its pure-Python parts (kaldi fbank, Resample), so drop the ops libraries.
  "$VENV/bin/python" -c "import torchaudio" 2>/dev/null || rm -f "$VENV"/lib/python3*/site-packages/torchaudio/lib/*.so
  "$VENV/bin/python" -c "import torchaudio.compliance.kaldi"
fi
"${PIP[@]}" install -q --no-deps --no-build-isolation -e .
echo "$want" > "$STAMP"
echo "[install] done: $VENV ($MODE)"
