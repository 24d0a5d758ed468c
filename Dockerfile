# GPU image for the 8-GPU recipe: verl's own image plus ttsrl's requirements.
#   docker build -t ttsrl --build-arg BASE_IMAGE=<a verl 0.9.1 + vLLM 0.24 image> .
#   docker run --gpus all --shm-size=64g -e PRESET=presets/gpu8.sh \
#       -v $PWD/pretrained_models:/ttsrl/pretrained_models -v $PWD/data:/ttsrl/data \
#       -v $PWD/exp:/ttsrl/exp ttsrl bash run.sh -1 5
# (the 8-GPU preset, with the folders it reads and writes mounted: docs/gpu.md; Docker's default
# 64 MB /dev/shm is too small for Ray's object store and NCCL)
# Any image with CUDA, Python 3.11-3.12 and verl 0.9.1's GPU stack works as the base;
# requirements.txt pins the versions ttsrl was written against (verl is pinned exactly).
ARG BASE_IMAGE=verlai/verl:vllm024.latest
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends espeak-ng git sox && rm -rf /var/lib/apt/lists/*

WORKDIR /ttsrl
COPY . .
# The same installer as on a bare node, into the image's interpreter: torch, then the rest,
# onnxruntime-gpu kept over faster-whisper's CPU onnxruntime, flash-attn only if the base
# image lacks the pinned version (then built from source: the base image must have nvcc),
# ttsrl itself (its vLLM plugin entry point), .venv/bin/python -> the image's python, and
# the same install stamp, so run.sh's stage -2 finds the image up to date.
RUN TTSRL_USE_PYTHON="$(command -v python)" PIP_NO_CACHE_DIR=1 bash scripts/install.sh --gpu \
 && python -c "import importlib.metadata as m; assert any(e.name == 'ttsrl_cosyvoice2' for e in m.entry_points(group='vllm.general_plugins'))" \
 && bash scripts/install.sh --gpu | grep -q "up to date"
CMD ["bash", "run.sh", "--help"]
