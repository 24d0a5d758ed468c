#!/usr/bin/env bash
# Stage -2: create .venv/ at the repo root and install ttsrl into it.
#   bash scripts/install.sh          CPU stack (laptop, CI): torch CPU + verl 0.9.1 + speech libs
#   bash scripts/install.sh --gpu    GPU stack of an 8-GPU node (requirements.txt)
# Idempotent: a second run with unchanged requirement files does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=cpu
usage() { sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; }
case $# in
  0) ;;
  1) case $1 in
       --gpu) MODE=gpu ;;
       -h|--help) usage; exit 0 ;;
       *) echo "install.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
     esac ;;
  *) echo "install.sh: one argument at most, got: $*" >&2; usage >&2; exit 2 ;;
esac
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

# Optional: shellcheck lints the shell scripts in the test suite (tests/test_run_sh.py skips without it).
if ! command -v shellcheck >/dev/null 2>&1 && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
  echo "[install] apt-get install shellcheck"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck >/dev/null) \
    || echo "[install] warning: shellcheck could not be installed; the shell lint test will skip"
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
fi
"${PIP[@]}" install -q --no-deps --no-build-isolation -e .
echo "$want" > "$STAMP"
echo "[install] done: $VENV ($MODE)"
