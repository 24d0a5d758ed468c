# GPU image for the 8-GPU recipe: verl's own image plus ttsrl's requirements.
#   docker build -t ttsrl --build-arg BASE_IMAGE=<a verl 0.9.1 + vLLM 0.24 image> .
#   docker run --gpus all --ipc=host -v $PWD/pretrained_models:/ttsrl/pretrained_models \
#       -v $PWD/exp:/ttsrl/exp ttsrl bash run.sh -1 5
# Any image with CUDA, Python 3.10-3.12 and verl 0.9.1's GPU stack works as the base;
# requirements.txt pins the versions ttsrl was written against (verl is pinned exactly).
ARG BASE_IMAGE=verlai/verl:vllm024.latest
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends espeak-ng git sox && rm -rf /var/lib/apt/lists/*

WORKDIR /ttsrl
COPY requirements.txt ./
RUN pip install --no-cache-dir -r requirements.txt
COPY . .
# the vLLM plugin entry point (ttsrl.vllm_plugin) is registered by the package install
RUN pip install --no-cache-dir --no-deps -e . \
 && python -c "import importlib.metadata as m; assert any(e.name == 'ttsrl_cosyvoice2' for e in m.entry_points(group='vllm.general_plugins'))"
# run.sh uses .venv/bin/python: point it at the image's interpreter
RUN mkdir -p .venv/bin && ln -s "$(command -v python)" .venv/bin/python \
 && touch .venv/.ttsrl-install-gpu
CMD ["bash", "run.sh", "--help"]
