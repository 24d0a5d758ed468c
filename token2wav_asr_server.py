#!/usr/bin/env python
"""Stage 1: the reward server (speech tokens -> audio -> ASR -> reward) over HTTP.

Speaks KServe v2 / Triton HTTP JSON: POST /v2/models/<model-name>/infer with inputs
TOKENS (INT32 [1,N]), TOKEN_LENS (INT32 [1,1]), GT_TEXT (BYTES [1,1]); answers
REWARDS (FP32), TRANSCRIPTS (BYTES), ERROR_RATES (FP32). See ttsrl/server.py.

Backends:
  sim         simulated codec (embedded preset; no audio, no model)
  whisper     espeak-ng voices the simulated codec's pinyin, Whisper transcribes
              (Whisper-base from the PyPI wheels on CPU, or --whisper-model-dir)
  cosyvoice2  CosyVoice2 flow + HiFT (--cosyvoice-model-dir, optional --cosyvoice-checkout,
              --prompt-dir) and Whisper or sherpa-onnx ASR (--asr)
"""

from __future__ import annotations

import argparse
import logging
import sys

from ttsrl.backends import ASRS, BACKENDS, BackendConfig
from ttsrl.server import ServerConfig, run


def parse_args(argv=None) -> ServerConfig:
    d = ServerConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, default="sim", help="token2wav + ASR preset (default: sim)")
    p.add_argument("--asr", choices=ASRS, default="default", help="override the preset's ASR")
    p.add_argument("--host", default=d.host, help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=d.port, help="port (default 8000; 0 = any free port)")
    p.add_argument("--model-name", default=d.model_name, help="model name in the URL (default token2wav_asr)")
    p.add_argument("--reward", default=d.reward, help="reward variant: tanh (reference formula, ttsrl normalisation), tanh_reference (also the reference's WeTextProcessing normalisation), toneless, cer_nll")
    p.add_argument("--no-length-guard", action="store_true",
                   help="do not lower rewards of speech much longer/shorter than the text needs")
    p.add_argument("--max-batch", type=int, default=d.max_batch, help="most requests in one backend batch")
    p.add_argument("--max-delay-ms", type=float, default=d.max_delay_ms,
                   help="longest wait after the oldest queued request before a batch runs")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="requests that may wait; beyond it the server answers 503 + Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="largest request body (413 above)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="most speech codes per sequence (413 above)")
    p.add_argument("--devices", default=None,
                   help="comma-separated devices, one backend replica each (default: all GPUs, else cpu)")
    p.add_argument("--whisper-model-dir", default=None,
                   help="CTranslate2 Whisper directory (default: Whisper-base from the PyPI wheels)")
    p.add_argument("--whisper-compute-type", default=None, help="CTranslate2 compute type (default int8 CPU, float16 GPU)")
    p.add_argument("--cpu-threads", type=int, default=0, help="threads per CPU backend (0 = all cores, max 8)")
    p.add_argument("--cosyvoice-checkout", default=None, help="CosyVoice source checkout (backend cosyvoice2); default: the installed cosyvoice package")
    p.add_argument("--cosyvoice-model-dir", default=None, help="CosyVoice2-0.5B model directory")
    p.add_argument("--prompt-dir", default=None, help="speaker prompts: *.wav (>= 16 kHz, <= 30 s); one is chosen per text")
    p.add_argument("--sherpa-model-dir", default=None, help="sherpa-onnx SenseVoice/Paraformer directory (--asr sherpa)")
    p.add_argument("--sherpa-kind", default="sense_voice", choices=("sense_voice", "paraformer"))
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    backend = BackendConfig(backend=a.backend, asr=a.asr, want_score=a.reward == "cer_nll",
                            whisper_model_dir=a.whisper_model_dir, whisper_compute_type=a.whisper_compute_type,
                            cpu_threads=a.cpu_threads, cosyvoice_checkout=a.cosyvoice_checkout,
                            cosyvoice_model_dir=a.cosyvoice_model_dir, prompt_dir=a.prompt_dir,
                            sherpa_model_dir=a.sherpa_model_dir, sherpa_kind=a.sherpa_kind)
    cfg = ServerConfig(backend=backend, host=a.host, port=a.port, model_name=a.model_name, reward=a.reward,
                       length_guard=not a.no_length_guard, max_batch=a.max_batch, max_delay_ms=a.max_delay_ms,
                       max_queue=a.max_queue, max_body_bytes=a.max_body_bytes, max_tokens=a.max_tokens,
                       devices=a.devices.split(",") if a.devices else None)
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
