"""The files of a model folder and of the trained steps: the one owner of the layout.

A model folder is a Hugging Face checkpoint in CosyVoice2's layout:

    model.safetensors | model-0000K-of-0000N.safetensors + model.safetensors.index.json
    config.json, generation_config.json, the tokenizer files (``TOKENIZER_FILES``)
    modeling_cosyvoice2.py          the class keeping the lm_head bias (``auto_map``)
    cosyvoice2_extra/inner_embed_tail.safetensors   unused inner rows (bit-exact export)

The converter (``ttsrl.model.convert``) writes the start model. Every trained step
(stage 3's merge of GRPO's FSDP shards, DPO/KTO's saves) is ``OUT/step_N`` in the same
layout plus ``MARKER`` (``MERGED.json``): what wrote it, and every file's size and
sha256. A step is written by :func:`writing_step` only: into a temporary sibling
folder, completed with the layout's files, its files' modes normalised, the marker
written last, every file synced and the folder renamed into place
(``ttsrl.atomic.atomic_dir``), so a crash leaves the old step or the new one, never a
partial ``step_N``. :func:`check_merged` is the one reader that trusts a step; every
stage that loads one (4, 5, the export) goes through it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from ttsrl.atomic import _umask, atomic_dir, remove_stale_temps, sha256_file

if TYPE_CHECKING:
    import torch

MARKER = "MERGED.json"
STEP_PREFIX = "step_"
STEP_RE = re.compile(r"^step_(\d+)$")
MODELING_FILE = Path(__file__).with_name("modeling_cosyvoice2.py")
EXTRA_FILE = "cosyvoice2_extra/inner_embed_tail.safetensors"
LEGACY_EXTRA_FILE = "cosyvoice2_extra.safetensors"  # written before; vLLM cannot load a folder with it
INDEX_FILE = "model.safetensors.index.json"
SHARD_BYTES = 1 << 30
# tokenizer and generation files; a writer that leaves them out gets them from its source
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json", "added_tokens.json", "vocab.json", "merges.txt")


# ---- weights and JSON files --------------------------------------------------------

def read_json_file(path: Path, what: str) -> dict:
    """A JSON object from ``path``, or ValueError naming the file and the place."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno} column {e.colno}: {e.msg}); expected {what}") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason}); expected {what}") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: a JSON {type(obj).__name__}, expected {what} (an object)")
    return obj


class ShardWriter:
    """Write tensors into safetensors shards of about ``max_bytes`` each, plus the
    standard ``model.safetensors.index.json`` when there is more than one shard."""

    def __init__(self, out_dir: Path, max_bytes: int = SHARD_BYTES):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[dict[str, torch.Tensor] | list[str]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = t.contiguous()
        self.pending_bytes += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        idx = len(self.shards)
        save_file(self.pending, str(self.out_dir / f"shard-{idx:05d}.safetensors"), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending:
            self._flush()
        n = len(self.shards)
        names = []
        for i in range(n):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out_dir / f"shard-{i:05d}.safetensors", self.out_dir / final)
            names.append(final)
        if n > 1:
            weight_map = {k: names[i] for i, keys in enumerate(self.shards) for k in keys}
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))


def read_hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint (lazy per file)."""
    from safetensors import safe_open

    index = Path(hf_dir) / INDEX_FILE
    if index.is_file():
        weight_map = read_json_file(index, "a safetensors shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: no \"weight_map\" object of tensor name -> shard file")
        files = sorted(set(weight_map.values()))
    elif (Path(hf_dir) / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
    out = {}
    for f in files:
        path = Path(hf_dir) / f
        if not path.is_file():
            raise FileNotFoundError(f"{path}: shard named by {index.name} not found")
        try:
            with safe_open(str(path), framework="pt") as fh:
                for k in fh.keys():
                    out[k] = fh.get_tensor(k)
        except Exception as e:  # SafetensorError: truncated, header damaged, not safetensors
            raise ValueError(f"{path}: cannot be read as safetensors, truncated or damaged? "
                             f"({type(e).__name__}: {e})") from e
    return out


# ---- step naming ------------------------------------------------------------------

class FamilyMismatch(ValueError):
    """A model folder of another family than the run's (MODEL_FAMILY)."""


def folder_family(folder: str | Path) -> str | None:
    """The family a model folder holds (its config.json's ``speech_family``, which the converter and
    every step writer record); None when the folder does not say (nothing to compare)."""
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    fam = cfg.get("speech_family") if isinstance(cfg, dict) else None
    return fam if isinstance(fam, str) else None


def check_family(folder: str | Path, family: str | None, what: str) -> None:
    """Raise :class:`FamilyMismatch` naming ``what`` (e.g. "step 41"), the folder, its family and the
    run's, when ``folder`` holds another family than ``family`` (None: not checked). Stage 4 and 5
    call it on every model before they use one: a CosyVoice3 step in a CosyVoice2 run would be
    decoded with the wrong rule or exported as the wrong family's llm.pt."""
    found = folder_family(folder)
    if family is not None and found is not None and found != family:
        raise FamilyMismatch(f"{what} ({folder}) is a {found} model, and this run's family is {family} "
                             f"(MODEL_FAMILY): it belongs to another run; move it out of the run's folders, "
                             f"or run with MODEL_FAMILY={found}")


def step_path(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / f"{STEP_PREFIX}{step}"


def step_folders(out_dir: str | Path) -> dict[int, Path]:
    """{N: OUT/step_N} for every folder named ``step_N`` (verified or not), by step."""
    out_dir = Path(out_dir)
    found = {}
    if out_dir.is_dir():
        for p in out_dir.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir():
                found[int(m.group(1))] = p
    return dict(sorted(found.items()))


# ---- the marker -------------------------------------------------------------------

def file_records(folder: Path) -> dict[str, dict]:
    """{relative path: {size, sha256}} of every file in ``folder`` but the marker."""
    out = {}
    for f in sorted(Path(folder).rglob("*")):
        if f.is_file() and f.name != MARKER:
            out[f.relative_to(folder).as_posix()] = {"size": f.stat().st_size, "sha256": sha256_file(f)}
    return out


def write_marker(step_dir: Path, info: dict) -> None:
    """Mark ``step_dir`` as a finished step: ``info`` plus every file's size and sha256.
    :func:`writing_step` calls it last; tests call it to make a folder look finished."""
    (Path(step_dir) / MARKER).write_text(json.dumps({**info, "files": file_records(step_dir)}, indent=2))


def read_marker(step_dir: Path) -> dict | None:
    """The marker's content, or None when there is none or it is not a JSON object."""
    try:
        info = json.loads((Path(step_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def check_merged(step_dir: Path, dtype: str | None = None, hashes: bool = True) -> str | None:
    """None when ``step_dir`` is a complete step (merged at ``dtype``, the merge's
    ``--dtype`` option, when given), else why not: no or unreadable marker, a recorded
    file missing, of another size or (``hashes``) another sha256, a weights file that
    does not open, another dtype."""
    step_dir = Path(step_dir)
    if not (step_dir / MARKER).is_file():
        return f"no {MARKER}"
    info = read_marker(step_dir)
    files = (info or {}).get("files")
    if not isinstance(files, dict) or not files:
        return f"{MARKER} unreadable or written by an older version (no file list)"
    if dtype is not None and info.get("dtype_option", "bf16-verl") != dtype:
        return f"merged with --dtype {info.get('dtype_option', 'bf16 (verl default)')}, not {dtype}"
    weights = [n for n in files if n.endswith(".safetensors")]
    if not weights:
        return f"{MARKER} lists no weights file"
    for name, rec in files.items():
        f = step_dir / name
        if not f.is_file():
            return f"{name} missing"
        if f.stat().st_size != rec.get("size"):
            return f"{name} has {f.stat().st_size} bytes, {rec.get('size')} recorded"
    if hashes:  # a file of the right size can still be corrupted: compare the content
        for name, rec in files.items():
            if not isinstance(rec.get("sha256"), str):
                return f"{MARKER} records no sha256 for {name}"
            if sha256_file(step_dir / name) != rec["sha256"]:
                return f"{name} does not match the sha256 in {MARKER} (changed or corrupted since it was written)"
    from safetensors import safe_open

    for name in weights:
        try:
            with safe_open(str(step_dir / name), framework="pt") as fh:
                list(fh.keys())
        except Exception as e:
            return f"{name} unreadable ({type(e).__name__}: {e})"
    return None


def merged_steps(out_dir: str | Path, warn: Callable[[str], None] | None = print) -> dict[int, Path]:
    """{N: OUT/step_N} for every step that passes :func:`check_merged`; ``warn`` (when not
    None) says which ``step_N`` is left out and why."""
    out = {}
    for step, p in step_folders(out_dir).items():
        why = check_merged(p)
        if why is None:
            out[step] = p
        elif warn is not None:
            warn(f"warning: {p} left out: not a complete, verified step ({why})")
    return out


# ---- writing a step ---------------------------------------------------------------

def normal_modes(folder: Path) -> None:
    """Files written through temp files (safetensors, tokenizer) may be private
    (0600); give everything the modes a plain write would have (0644 under umask 022)."""
    mask = _umask()
    for f in Path(folder).rglob("*"):
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~mask)


def complete_layout(folder: Path, modules: Sequence[Path] = (MODELING_FILE,),
                    tokenizer_from: Path | None = None, extra_from: Path | None = None) -> None:
    """Add to a folder of weights + config what the layout needs and the writer left
    out: the remote-code ``modules``, the tokenizer files of ``tokenizer_from`` and the
    converter's side file of ``extra_from`` (the base model), where they exist."""
    for src in modules:
        shutil.copy2(src, folder / Path(src).name)
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).is_file() and not (folder / name).exists():
                shutil.copy2(Path(tokenizer_from) / name, folder / name)
    if extra_from is not None and (Path(extra_from) / EXTRA_FILE).is_file():
        (folder / EXTRA_FILE).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(extra_from) / EXTRA_FILE, folder / EXTRA_FILE)


@contextmanager
def writing_step(target: Path, info: dict, modules: Sequence[Path] = (MODELING_FILE,),
                 tokenizer_from: Path | None = None, extra_from: Path | None = None) -> Iterator[Path]:
    """Yield a temporary folder next to ``target`` (``OUT/step_N``) for the weights and
    config; on success complete it (:func:`complete_layout`), write the marker (``info``
    + ``remote_code`` + ``merged_at`` + every file's record) last, sync and rename it
    into place, replacing an existing ``target``. On error nothing of it remains.
    The caller decides whether ``target`` may be replaced. What a killed writer left
    next to it (``.step_N.tmp-PID-*`` of a dead PID) is deleted first."""
    remove_stale_temps(Path(target).parent)
    with atomic_dir(target) as tmp:
        yield tmp
        complete_layout(tmp, modules, tokenizer_from, extra_from)
        normal_modes(tmp)
        write_marker(tmp, {"remote_code": [Path(m).name for m in modules],
                           "merged_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **info})
        normal_modes(tmp)
