"""python -m ttsrl.fetch: fetch, lay out and record every input of the GPU recipe that has a public source.

    python -m ttsrl.fetch --preset presets/gpu8.sh          # what that preset's run needs (its FETCH_ARGS)
    python -m ttsrl.fetch --model-dir pretrained_models/CosyVoice2-0.5B --seedtts-dir data/seedtts_testset/zh

run.sh runs it at the start of stage -1 (presets with FETCH_ARGS). Each input is fetched once: its
folder's fetch_manifest.json records source, size and sha256 of every file, a rerun checks them and
fetches nothing, a file that differs is named and fetched again; one placed by hand (no manifest) is
left alone. Without a network (HF_HUB_OFFLINE=1, or the hub does not answer one short probe) it stops
at once with one message: every missing input, its source, the command that fetches it elsewhere and
how to place it by hand. HF_ENDPOINT names a Hugging Face mirror; with the modelscope package
installed, --source modelscope (or auto, when Hugging Face cannot be reached) takes the model folders
from ModelScope (MODELSCOPE_DOMAIN). Exit 0: every input in place; 1: the message says what is not.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

from ttsrl.cli import add_fields, option, parse_into
from ttsrl.families import token2wav_families
from ttsrl.fetch.inputs import catalogue, fetch, run_tokens


def preset_args(preset: str) -> list[str]:
    """The FETCH_ARGS a preset sets (sourced by bash as run.sh sources it)."""
    script = 'set +u; source "$1" >/dev/null; [[ -n ${FETCH_ARGS+set} ]] || exit 3; printf "%s\\0" "${FETCH_ARGS[@]}"'
    r = subprocess.run(["bash", "-c", script, "preset", preset], capture_output=True)
    if r.returncode == 3:
        raise SystemExit(f"{preset} sets no FETCH_ARGS (it names no input to fetch)")
    if r.returncode:
        raise SystemExit(f"sourcing {preset} failed: {r.stderr.decode(errors='replace').strip()}")
    return [w.decode() for w in r.stdout.split(b"\0")[:-1]]


@dataclass
class FetchConfig:
    """What to fetch; each field is an option of ``python -m ttsrl.fetch``."""
    preset: Optional[str] = option(None, metavar="FILE", help="take the inputs from this preset's FETCH_ARGS")
    model_dir: Optional[str] = option(None, metavar="DIR", help="the model folder (COSYVOICE2_DIR) of --backend's "
                                                                "release")
    backend: str = option(token2wav_families()[0], choices=token2wav_families(),
                          help="the model family whose release --model-dir is")
    sherpa_model_dir: Optional[str] = option(None, metavar="DIR", help="the sherpa-onnx Paraformer (ASR_MODEL_DIR)")
    train_file: Optional[str] = option(None, metavar="FILE", help="training texts (TRAIN_FILE)")
    seedtts_dir: Optional[str] = option(None, metavar="DIR", help="Seed-TTS test_zh (SEEDTTS_ZH_DIR)")
    cv3_dir: Optional[str] = option(None, metavar="DIR", help="CV3-Eval zero_shot zh (CV3_ZH_DIR)")
    prompt_dir: Optional[str] = option(None, metavar="DIR", help="speaker prompts (PROMPT_DIR)")
    prompt_pool: Optional[str] = option(None, metavar="DIR", help="the zero-shot prompt pool (PROMPT_POOL)")
    cosyvoice_checkout: Optional[str] = option(None, metavar="DIR", help="passed to scripts/prompt_tokens.py")
    source: str = option("auto", choices=("auto", "huggingface", "modelscope"),
                         help="auto: Hugging Face (HF_ENDPOINT), ModelScope for the model folders when Hugging Face "
                              "cannot be reached and modelscope is installed")
    prompt_tokens: bool = option(True, flag="--no-prompt-tokens", negated=True,
                                 help="do not run scripts/prompt_tokens.py")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ttsrl.fetch", description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fields(ap, FetchConfig)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser()
    a = parse_into(ap, FetchConfig, ap.parse_args(argv))
    if a.preset:
        rest = [w for w in argv if w != a.preset and w != "--preset"]
        a = parse_into(ap, FetchConfig, ap.parse_args(preset_args(a.preset) + rest))
    inputs = catalogue(model_dir=a.model_dir, backend=a.backend, sherpa_model_dir=a.sherpa_model_dir,
                       train_file=a.train_file, seedtts_dir=a.seedtts_dir, cv3_dir=a.cv3_dir,
                       prompt_dir=a.prompt_dir, prompt_pool=a.prompt_pool)
    if not inputs:
        ap.error("name at least one input (or --preset FILE)")
    rc, message = fetch(inputs, source=a.source, model_dir=a.model_dir, backend=a.backend,
                        checkout=a.cosyvoice_checkout, make_tokens=run_tokens if a.prompt_tokens else None)
    print(message, file=sys.stderr if rc else sys.stdout)
    return rc


if __name__ == "__main__":
    sys.exit(main())
