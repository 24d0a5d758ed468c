"""The output folder of DPO/KTO training (``train_dpo.py --out-dir``): its run record
and its ``step_N`` folders in the merged layout.

Rules (stages 4 and 5 read these folders as trained weights, so none may be stale):

* ``OUT/RUN.json`` records the settings that make the weights (trainer, loss, beta,
  lr, batch, steps, seed, model, the pairs file's sha256, ...). A run into a folder
  holding another run's steps starts only when the settings are the same (it then
  trains again and rewrites every step it saves: nothing of the old weights stays),
  or with ``--force``, which first removes the old run's steps. Otherwise it stops
  before training with the settings that differ.
* A ``step_N`` that this trainer did not write (no ``MERGED.json`` naming a dpo/kto
  trainer) is never deleted or replaced: the run stops and names it.
* A step is always written whole (temp folder + rename) with a marker recording every
  file's size and sha256; a step whose files fail that check is rewritten, not kept.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from ttsrl.atomic import atomic_write_text, sha256_file
from ttsrl.model.checkpoint import MODELING_FILE, read_marker, step_folders, step_path, writing_step

RUN_FILE = "RUN.json"
TRAINERS = ("dpo", "kto")


class OutputDirError(ValueError):
    """The output folder cannot take this run: the message says why and what to do."""


def _marker(step: Path) -> dict | None:
    """The step's marker when this trainer wrote it, else None."""
    info = read_marker(step)
    return info if info is not None and info.get("trainer") in TRAINERS else None


def run_settings(args: dict, model: Path, pairs: Path) -> dict:
    """The settings that determine a run's weights (recorded in RUN.json and every marker)."""
    return {**args, "model": str(Path(model).resolve()), "pairs": str(Path(pairs).resolve()),
            "pairs_sha256": sha256_file(pairs)}


def _recorded(out_dir: Path, steps: list[Path]) -> dict | None:
    try:
        return json.loads((out_dir / RUN_FILE).read_text())["settings"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    for s in steps:  # no readable RUN.json (removed, or steps copied in): what a step's marker records
        info = _marker(s) or {}
        if isinstance(info.get("run"), dict):
            return info["run"]
    return None


def differences(old: dict, new: dict) -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        if k not in old:
            out.append(f"{k}: not recorded by the earlier run, now {new[k]!r}")
        elif old[k] != new.get(k):
            out.append(f"{k}: {old[k]!r} then, {new.get(k)!r} now")
    return out


def prepare_out_dir(out_dir: Path, settings: dict, force: bool = False,
                    log: Callable[[str], None] = print, write: bool = True) -> None:
    """Check ``out_dir`` against the rules of the module doc, then record ``settings``
    (``write=False``: check only, as every rank but the first of a launch does)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputDirError(f"--out-dir {out_dir} is a file, not a folder")
    steps = list(step_folders(out_dir).values())
    foreign = [s for s in steps if _marker(s) is None]
    if foreign:
        raise OutputDirError(
            f"--out-dir {out_dir}: {', '.join(s.name for s in foreign)} not written by train_dpo.py (no MERGED.json "
            "naming a dpo/kto run); it is never deleted: move it away or choose another --out-dir")
    if steps:  # a RUN.json without steps (a run that stopped before saving) holds nothing to protect
        old = _recorded(out_dir, steps)
        diff = differences(old or {}, settings)
        if diff and not force:
            raise OutputDirError(
                f"--out-dir {out_dir} holds a run with other settings ({len(steps)} step folder(s)); stages 4 and 5 "
                "would mix its weights with this run's. What differs:\n  " + "\n  ".join(diff)
                + "\nRun with the same settings, choose another --out-dir, or pass --force to delete that run's "
                "steps first.")
        if not write:
            return
        if diff:
            for s in steps:
                shutil.rmtree(s)
            log(f"--force: removed the earlier run's {len(steps)} step folder(s) in {out_dir}")
        else:
            log(f"{out_dir} holds a run with the same settings: training again, every step it saves is rewritten")
    if not write:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / RUN_FILE, json.dumps({"settings": settings,
                                                      "started_at": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2))


def finish_step_dir(saved: Path, target: Path, base_model: Path, step: int, info: dict) -> Path:
    """Turn a ``save_model`` folder into ``target`` (``OUT/step_N``) in the layout stage 3
    writes, through ``ttsrl.model.checkpoint.writing_step``: its files move into the
    step's temporary folder, the config gets the base model's remote-code keys, the
    modeling file (the class with the biased head), tokenizer files and side file of
    the base model are added, the marker is written last and the folder renamed into
    place. Only a step this trainer wrote is replaced."""
    base_model = Path(base_model)
    if target.exists() and _marker(target) is None:
        raise OutputDirError(f"{target} appeared during training and was not written by train_dpo.py; "
                             f"left as it is, this step is in {saved}")
    marker = {"step": step, "source": info.get("source", "ttsrl.train.dpo"), **info}
    with writing_step(target, marker, (MODELING_FILE,), tokenizer_from=base_model, extra_from=base_model) as tmp:
        for p in saved.iterdir():
            os.replace(p, tmp / p.name)
        cfg_path = tmp / "config.json"
        base_cfg = json.loads((base_model / "config.json").read_text())
        cfg = json.loads(cfg_path.read_text())
        for k in ("auto_map", "speech_output_range", "architectures"):  # keep remote-code loading
            if k in base_cfg:
                cfg[k] = base_cfg[k]
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    saved.rmdir()
    return target


def make_save_callback(out_dir: Path, base_model: Path, save_steps: int, info: dict):
    """A ``TrainerCallback`` that writes ``out_dir/step_N`` every ``save_steps`` and at
    the end (all ranks call ``save_model``; rank 0 completes the folder). Every step is
    written, never skipped because a folder of that name exists (see the module doc)."""
    from transformers import TrainerCallback

    name = info.get("trainer", "dpo")

    class SaveSteps(TrainerCallback):
        trainer = None
        saved: set[int] = set()

        def _save(self, state):
            step = state.global_step
            target = step_path(out_dir, step)
            if step == 0 or step in self.saved:  # on_train_end after a save at the same step
                return
            self.saved.add(step)
            save_dir = out_dir / f".step_{step}.partial"  # a name every rank knows; rank 0 finishes it
            if self.trainer.accelerator.is_main_process and save_dir.exists():
                shutil.rmtree(save_dir)
            self.trainer.accelerator.wait_for_everyone()
            self.trainer.save_model(str(save_dir))
            if self.trainer.accelerator.is_main_process:
                finish_step_dir(save_dir, target, base_model, step, info)
                print(f"[{name}] saved {target}", flush=True)
            self.trainer.accelerator.wait_for_everyone()

        def on_step_end(self, args, state, control, **kw):
            if save_steps > 0 and state.global_step % save_steps == 0:
                self._save(state)

        def on_train_end(self, args, state, control, **kw):
            self._save(state)

    cb = SaveSteps()
    cb.saved = set()
    return cb
