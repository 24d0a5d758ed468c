#!/usr/bin/env python
"""Stage 1: the reward server (speech tokens -> audio -> ASR -> reward) over HTTP.

Speaks KServe v2 / Triton HTTP JSON: POST /v2/models/<model-name>/infer with inputs
TOKENS (INT32 [1,N]), TOKEN_LENS (INT32 [1,1]), GT_TEXT (BYTES [1,1]); answers
REWARDS (FP32), TRANSCRIPTS (BYTES), ERROR_RATES (FP32), SIMS (FP32: speaker similarity,
NaN unless --want-sim or --sim-weight). See ttsrl/reward/protocol.py.

Backends:
  sim         simulated codec (embedded preset; no audio, no model)
  whisper     espeak-ng voices the simulated codec's pinyin, Whisper transcribes
              (Whisper-base from the PyPI wheels on CPU, or --whisper-model-dir)
  cosyvoice2  CosyVoice2 flow + HiFT (--cosyvoice-checkout, --cosyvoice-model-dir,
              --prompt-dir) and Whisper or sherpa-onnx ASR (--asr)
"""

from __future__ import annotations

import argparse
import logging
import sys

from ttsrl.reward.backends.options import add_backend_args, backend_config
from ttsrl.reward.rewards import REWARDS
from ttsrl.reward.server import ServerConfig, run


def parse_args(argv=None) -> ServerConfig:
    d = ServerConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_backend_args(p)
    p.add_argument("--host", default=d.host, help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=d.port, help="port (default %(default)s; 0 = any free port)")
    p.add_argument("--model-name", default=d.model_name, help="model name in the URL (default %(default)s)")
    p.add_argument("--reward", default=d.reward, choices=sorted(REWARDS),
                   help="reward variant: tanh (reference formula, ttsrl normalisation), tanh_reference (also the "
                        "reference's WeTextProcessing normalisation), toneless, cer_nll (default %(default)s)")
    p.add_argument("--no-length-guard", action="store_true",
                   help="do not lower rewards of speech much longer/shorter than the text needs")
    p.add_argument("--want-sim", action="store_true",
                   help="measure each utterance's speaker similarity to its prompt (cosine of CosyVoice2's campplus "
                        "embeddings) and return it as SIMS, without adding it to the reward (for logging, and for "
                        "GRPO's --algorithm gdpo, which weighs it itself); needs a backend with a speaker model "
                        "(cosyvoice2)")
    p.add_argument("--sim-weight", type=float, default=d.sim_weight, metavar="W",
                   help="reward = error-rate reward + W x SIM (GLM-TTS uses 0.1; implies --want-sim; needs a "
                        "backend with a speaker model) (default %(default)s: the error-rate reward alone)")
    p.add_argument("--max-batch", type=int, default=d.max_batch, help="most requests in one backend batch")
    p.add_argument("--max-delay-ms", type=float, default=d.max_delay_ms,
                   help="longest wait after the oldest queued request before a batch runs")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="requests that may wait; beyond it the server answers 503 + Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="largest request body (413 above)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="most speech codes per sequence (413 above)")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections at most; beyond it the longest-idle one is closed "
                        "(default 0 = half the file-descriptor limit, at most 1024)")
    p.add_argument("--idle-timeout-s", type=float, default=d.idle_timeout_s,
                   help="close a connection that sends no complete request headers for this long "
                        "(also idle keep-alive connections) (default %(default)s)")
    p.add_argument("--body-timeout-s", type=float, default=d.body_timeout_s,
                   help="answer 408 when a request body takes longer than this (default %(default)s)")
    p.add_argument("--devices", default=None,
                   help="comma-separated devices, one backend replica each (default: all GPUs, else cpu)")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    backend = backend_config(a, want_score=a.reward == "cer_nll")
    cfg = ServerConfig(backend=backend, host=a.host, port=a.port, model_name=a.model_name, reward=a.reward,
                       length_guard=not a.no_length_guard, want_sim=a.want_sim, sim_weight=a.sim_weight,
                       max_batch=a.max_batch, max_delay_ms=a.max_delay_ms,
                       max_queue=a.max_queue, max_body_bytes=a.max_body_bytes, max_tokens=a.max_tokens,
                       devices=a.devices.split(",") if a.devices else None, max_connections=a.max_connections,
                       idle_timeout_s=a.idle_timeout_s, body_timeout_s=a.body_timeout_s)
    try:
        cfg.validate()
    except ValueError as e:
        p.error(str(e))
    return cfg


def main(argv=None) -> None:
    cfg = parse_args(argv)
    run(cfg, announce=lambda line: print(line, flush=True))


if __name__ == "__main__":
    sys.exit(main())
