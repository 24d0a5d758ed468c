# shellcheck shell=bash
# Helpers for building flash-attn from source (sourced by scripts/install.sh --gpu; tested in
# tests/test_run_sh.py with fake nvcc/nvidia-smi programs on PATH).

# nvcc_path: the nvcc that torch's extension builder will use (CUDA_HOME first, then PATH,
# then /usr/local/cuda, as torch.utils.cpp_extension looks for it).
nvcc_path() {
  if [[ -n ${CUDA_HOME:-} && -x $CUDA_HOME/bin/nvcc ]]; then
    echo "$CUDA_HOME/bin/nvcc"
  elif command -v nvcc >/dev/null 2>&1; then
    command -v nvcc
  elif [[ -x /usr/local/cuda/bin/nvcc ]]; then
    echo /usr/local/cuda/bin/nvcc
  else
    return 1
  fi
}

# nvcc_release NVCC: "13.0" from `nvcc --version` ("Cuda compilation tools, release 13.0, V13.0.48")
nvcc_release() { "$1" --version 2>/dev/null | sed -nE 's/.*release ([0-9]+\.[0-9]+).*/\1/p' | head -1; }

# flash_attn_toolchain TORCH_CUDA: status 0 when an nvcc of torch's CUDA major version is there
# (torch refuses to build an extension with another major); else a message on stderr, status 1.
flash_attn_toolchain() {
  local torch_cuda=$1 nvcc rel
  if [[ -z $torch_cuda ]]; then
    echo "[install] error: this torch is not a CUDA build; flash-attn needs one (or TTSRL_SKIP_FLASH_ATTN=1)" >&2
    return 1
  fi
  if ! nvcc=$(nvcc_path); then
    echo "[install] error: flash-attn has no wheel on PyPI and builds from source with nvcc: install the" \
      "CUDA $torch_cuda toolkit (torch's CUDA), set CUDA_HOME, and run this again (or TTSRL_SKIP_FLASH_ATTN=1)" >&2
    return 1
  fi
  rel=$(nvcc_release "$nvcc")
  if [[ ${rel%%.*} != "${torch_cuda%%.*}" ]]; then
    echo "[install] error: $nvcc is CUDA ${rel:-of unknown version}, torch was built with CUDA $torch_cuda:" \
      "torch builds extensions only with the same major version. Install the CUDA ${torch_cuda%%.*}.x toolkit" \
      "(a 580+ driver runs it), point CUDA_HOME at it, and run this again (or TTSRL_SKIP_FLASH_ATTN=1)" >&2
    return 1
  fi
  echo "[install] flash-attn toolchain: $nvcc (CUDA $rel) for torch CUDA $torch_cuda"
}

# FLASH_ATTN_BUILDS: the FLASH_ATTN_CUDA_ARCHS entries for which flash-attn 2.8.3's setup.py adds a
# -gencode (it reads no other variable and builds all four by default: hours); for any other entry
# it adds none and torch's extension builder picks the architectures itself.
FLASH_ATTN_BUILDS="80;90;100;120"

# fa_arch CC: the flash-attn build target that runs on compute capability CC ("8.6", "9.0a",
# "8.6+PTX", "86"): a cubin runs on the later minors of its major, so 8.x -> 80, 9.0 -> 90,
# 10.x -> 100, 12.x -> 120; status 1 for a GPU flash-attn 2 cannot serve (before 8.0, 11.x).
fa_arch() {
  local cc=${1%+PTX} major
  cc=${cc%[af]}
  if [[ $cc =~ ^([0-9]+)\.[0-9]+$ ]]; then
    major=${BASH_REMATCH[1]}
  elif [[ $cc =~ ^([0-9]+)[0-9]$ ]]; then
    major=${BASH_REMATCH[1]}
  else
    return 1
  fi
  case $major in
    8) echo 80 ;;
    9) echo 90 ;;
    10) echo 100 ;;
    12) echo 120 ;;
    *) return 1 ;;
  esac
}

# flash_attn_archs: FLASH_ATTN_CUDA_ARCHS for the build, e.g. "90" or "80;90". The user's
# FLASH_ATTN_CUDA_ARCHS wins, as given; else TORCH_CUDA_ARCH_LIST, translated (flash-attn's own
# -gencode flags make torch's builder ignore it); else the compute capabilities of this machine's
# GPUs (nvidia-smi); else, with no GPU visible (a docker build), 90 (H100/H200), said on stderr.
# One architecture builds in a fraction of the default four's time. Status 1 with a message
# for a GPU flash-attn 2 cannot serve (found before the long install, not deep in the compile).
flash_attn_archs() {
  local list src cc a out=""
  if [[ -n ${FLASH_ATTN_CUDA_ARCHS:-} ]]; then
    echo "$FLASH_ATTN_CUDA_ARCHS"
    return
  fi
  if [[ -n ${TORCH_CUDA_ARCH_LIST:-} ]]; then
    list=${TORCH_CUDA_ARCH_LIST//;/ }
    src="TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
  else
    list=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d ' ' \
      | grep -E '^[0-9]+\.[0-9]+$' | sort -u || true)
    src="this machine's GPUs (nvidia-smi)"
  fi
  if [[ -z ${list//[[:space:]]/} ]]; then
    echo "[install] note: no GPU visible (nvidia-smi): flash-attn is built for 90 (H100/H200);" \
      "set FLASH_ATTN_CUDA_ARCHS (one or more of $FLASH_ATTN_BUILDS) for other GPUs" >&2
    echo 90
    return
  fi
  for cc in $list; do
    if ! a=$(fa_arch "$cc"); then
      echo "[install] error: compute capability $cc ($src): flash-attn 2.8.3 runs on 8.x, 9.0, 10.x and 12.x" \
        "GPUs only. Set TTSRL_SKIP_FLASH_ATTN=1 to install without it (training then needs" \
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa)" >&2
      return 1
    fi
    [[ ";$out;" == *";$a;"* ]] || out=${out:+$out;}$a
  done
  tr ';' '\n' <<<"$out" | sort -n | paste -sd';' -
}

# flash_attn_imports PYTHON: status 0 when flash_attn and its compiled extension flash_attn_2_cuda
# import in PYTHON; else a message on stderr, status 1 (a build against another torch fails here,
# with an undefined symbol, instead of in the first training step).
flash_attn_imports() {
  local out
  if out=$("$1" -c 'import flash_attn, flash_attn_2_cuda; print(flash_attn.__version__)' 2>&1); then
    echo "[install] flash-attn ${out##*$'\n'} imports, with its compiled extension flash_attn_2_cuda"
    return 0
  fi
  echo "[install] error: flash-attn does not import in $1 with its compiled extension flash_attn_2_cuda:" \
    "$(tail -n 1 <<<"$out")" >&2
  echo "  an undefined symbol means it was built against another torch than this venv's: reinstall it" \
    "(pip uninstall -y flash-attn, then this installer again) with the CUDA toolkit of torch's CUDA" >&2
  return 1
}
