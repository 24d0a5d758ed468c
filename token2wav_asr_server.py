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
  cosyvoice3  CosyVoice3 DiT flow + causal HiFT, 24 kHz (--cosyvoice-checkout: a CosyVoice
              source checkout with CosyVoice3, which the PyPI package lacks;
              --cosyvoice-model-dir: Fun-CosyVoice3-0.5B-2512; --prompt-dir) and Whisper or --asr
"""

from __future__ import annotations

import argparse
import logging
import sys

from ttsrl.cli import add_fields, parse_into
from ttsrl.reward.backends.options import add_backend_args, backend_config
from ttsrl.reward.server import ServerConfig, run


def parser() -> argparse.ArgumentParser:
    """One option per field of BackendConfig and ServerConfig."""
    # allow_abbrev=False: run.sh refuses REWARD_ARGS that set the reward's identity by whole flags; an abbreviation (--rew) would pass that check
    p = argparse.ArgumentParser(allow_abbrev=False, prog="token2wav_asr_server.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_backend_args(p)
    add_fields(p, ServerConfig)
    return p


def parse_args(argv=None) -> ServerConfig:
    p = parser()
    a = p.parse_args(argv)
    cfg = parse_into(p, ServerConfig, a, backend=backend_config(a))
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
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
