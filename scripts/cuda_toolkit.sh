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

# flash_attn_archs: the GPU architectures to compile for. FLASH_ATTN_CUDA_ARCHS wins; else the
# compute capabilities of the GPUs on this machine (nvidia-smi, e.g. "90"); else 90 (H100/H200).
# One architecture builds in a fraction of the default four's time.
flash_attn_archs() {
  local found
  if [[ -n ${FLASH_ATTN_CUDA_ARCHS:-} ]]; then
    echo "$FLASH_ATTN_CUDA_ARCHS"
    return
  fi
  found=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d ' .' | grep -E '^[0-9]+$' \
    | sort -u | paste -sd';' -)
  echo "${found:-90}"
}
