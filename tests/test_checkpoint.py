"""The one owner of the step layout (ttsrl.model.checkpoint): a step folder appears whole
or not at all, even when its writer is killed; DPO's saves and stage 3's merge leave the
same files and marker, read by the same check; ``atomic_torch_save`` never leaves a
partial file. Real files, real processes killed with SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ttsrl.atomic import atomic_torch_save, remove_stale_temps
from ttsrl.model.checkpoint import (
    EXTRA_FILE,
    MARKER,
    MODELING_FILE,
    TOKENIZER_FILES,
    check_merged,
    merged_steps,
    read_marker,
    step_path,
    writing_step,
)
from ttsrl.model.convert import CONVERTED_MARKER
from ttsrl.train.dpo_out import OutputDirError, finish_step_dir
from ttsrl.train.steps import model_dir_for

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def weights_only(base: Path, to: Path) -> Path:
    """What a trainer's save leaves: weights and a config without our remote-code keys."""
    to.mkdir(parents=True)
    shutil.copy2(base / "model.safetensors", to / "model.safetensors")
    cfg = json.loads((base / "config.json").read_text())
    for k in ("auto_map", "speech_output_range"):
        cfg.pop(k)
    cfg["architectures"] = ["Qwen2ForCausalLM"]
    (to / "config.json").write_text(json.dumps(cfg))
    return to


def files_of(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_a_written_step_has_the_base_layout_and_a_marker_written_last(tiny_hf, tmp_path):
    target = step_path(tmp_path / "merged", 3)
    with writing_step(target, {"step": 3, "source": "test"}, tokenizer_from=tiny_hf, extra_from=tiny_hf) as tmp:
        weights_only(tiny_hf, tmp / "w")
        for p in (tmp / "w").iterdir():
            p.rename(tmp / p.name)
        (tmp / "w").rmdir()
        assert not target.exists()  # nothing visible before the end
    assert files_of(target) == files_of(tiny_hf) - {CONVERTED_MARKER} | {MARKER}
    info = read_marker(target)
    assert info["step"] == 3 and info["remote_code"] == [MODELING_FILE.name] and set(info["files"]) == \
        files_of(target) - {MARKER}
    assert check_merged(target) is None and merged_steps(tmp_path / "merged") == {3: target}
    mask = os.umask(0)
    os.umask(mask)
    assert {stat.S_IMODE(p.stat().st_mode) for p in target.rglob("*") if p.is_file()} == {0o666 & ~mask}
    assert [p.name for p in target.parent.iterdir()] == ["step_3"]  # no temp left


def test_an_error_inside_the_writer_leaves_the_old_step_and_no_temp(tiny_hf, tmp_path):
    out = tmp_path / "merged"
    old = step_path(out, 2)
    with writing_step(old, {"step": 2}) as tmp:  # a finished step_2
        shutil.copytree(tiny_hf, tmp, dirs_exist_ok=True)
    before = (old / MARKER).read_bytes()
    with pytest.raises(RuntimeError, match="disk full"):
        with writing_step(old, {"step": 2, "source": "second"}) as tmp:
            weights_only(tiny_hf, tmp / "x")
            raise RuntimeError("disk full")
    assert (old / MARKER).read_bytes() == before and check_merged(old) is None
    assert sorted(p.name for p in out.iterdir()) == ["step_2"]


CHILD = """
import shutil, sys, time
from pathlib import Path
from ttsrl.model import checkpoint
base, target, when = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
if when == "after-marker":  # stop after the marker is written, before the folder is renamed
    write = checkpoint.write_marker
    def write_marker(folder, info):
        write(folder, info)
        print(folder, flush=True)
        time.sleep(600)
    checkpoint.write_marker = write_marker
with checkpoint.writing_step(target, {"step": 4}, tokenizer_from=base, extra_from=base) as tmp:
    shutil.copy2(base / "model.safetensors", tmp / "model.safetensors")
    shutil.copy2(base / "config.json", tmp / "config.json")
    if when == "mid-write":
        print(tmp, flush=True)
        time.sleep(600)
"""


@pytest.mark.parametrize("when", ["mid-write", "after-marker"])
@pytest.mark.parametrize("had_old", [False, True])
def test_a_writer_killed_at_any_point_leaves_the_old_step_or_none(tiny_hf, tmp_path, when, had_old):
    out = tmp_path / "merged"
    target = step_path(out, 4)
    if had_old:
        with writing_step(target, {"step": 4, "source": "old"}) as tmp:
            shutil.copytree(tiny_hf, tmp, dirs_exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tiny_hf), str(target), when], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, text=True)
    try:
        temp = Path(proc.stdout.readline().strip())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert temp.parent == out and temp.name.startswith(".step_4.tmp-") and temp.is_dir()
    assert (temp / MARKER).is_file() == (when == "after-marker")
    if had_old:
        assert read_marker(target)["source"] == "old" and check_merged(target) is None
        assert merged_steps(out) == {4: target}
    else:
        assert not target.exists() and merged_steps(out) == {}
    # the next writer of a step there deletes the dead writer's temp folder
    with writing_step(step_path(out, 5), {"step": 5}) as tmp:
        shutil.copytree(tiny_hf, tmp, dirs_exist_ok=True)
    assert not temp.exists()
    assert sorted(p.name for p in out.iterdir()) == (["step_4", "step_5"] if had_old else ["step_5"])


def test_dpo_saves_in_the_same_layout_and_marker_as_a_merged_step(tiny_hf, tmp_path):
    """A DPO step (finish_step_dir) and a step written with stage 3's arguments: the same
    files, the same marker keys, both trusted by the one reader and loadable by step."""
    out = tmp_path / "merged"
    with writing_step(step_path(out, 2), {"step": 2, "source": "global_step_2/actor", "dtype_option": "auto"},
                      (MODELING_FILE,), tokenizer_from=tiny_hf, extra_from=tiny_hf) as tmp:  # as merge_step
        weights_only(tiny_hf, tmp / "w")
        for p in (tmp / "w").iterdir():
            p.rename(tmp / p.name)
        (tmp / "w").rmdir()
    saved = weights_only(tiny_hf, out / ".step_4.partial")
    finish_step_dir(saved, step_path(out, 4), tiny_hf, 4, {"trainer": "dpo", "beta": 0.1})
    assert not saved.exists()
    grpo, dpo = step_path(out, 2), step_path(out, 4)
    assert files_of(dpo) == files_of(grpo) == files_of(tiny_hf) - {CONVERTED_MARKER} | {MARKER}
    assert {"step", "source", "remote_code", "merged_at", "files"} <= set(read_marker(grpo)) & set(read_marker(dpo))
    assert read_marker(dpo)["trainer"] == "dpo" and read_marker(dpo)["step"] == 4
    assert merged_steps(out) == {2: grpo, 4: dpo}
    assert model_dir_for(4, tiny_hf, out) == dpo
    cfg = json.loads((dpo / "config.json").read_text())  # remote-code loading restored from the base model
    assert cfg["auto_map"] == json.loads((tiny_hf / "config.json").read_text())["auto_map"]
    assert (dpo / EXTRA_FILE).read_bytes() == (tiny_hf / EXTRA_FILE).read_bytes()
    assert all((dpo / n).read_bytes() == (tiny_hf / n).read_bytes() for n in TOKENIZER_FILES if (tiny_hf / n).exists())


def test_dpo_never_replaces_a_step_it_did_not_write(tiny_hf, tmp_path):
    out = tmp_path / "merged"
    with writing_step(step_path(out, 2), {"step": 2, "source": "stage 3"}) as tmp:  # a GRPO step: no trainer
        shutil.copytree(tiny_hf, tmp, dirs_exist_ok=True)
    before = (step_path(out, 2) / MARKER).read_bytes()
    saved = weights_only(tiny_hf, out / ".step_2.partial")
    with pytest.raises(OutputDirError, match=r"not written by train_dpo.py.*this step is in .*\.step_2\.partial"):
        finish_step_dir(saved, step_path(out, 2), tiny_hf, 2, {"trainer": "dpo"})
    assert (step_path(out, 2) / MARKER).read_bytes() == before and (saved / "model.safetensors").is_file()


class Boom:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this")


def test_atomic_torch_save_failing_midway_keeps_the_old_file(tmp_path):
    path = tmp_path / "llm.pt"
    atomic_torch_save({"w": torch.ones(3)}, path)
    before = path.read_bytes()
    with pytest.raises(RuntimeError, match="cannot pickle"):
        atomic_torch_save({"w": torch.zeros(1 << 16), "z": Boom()}, path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["llm.pt"]
    assert torch.equal(torch.load(path)["w"], torch.ones(3))


def test_atomic_torch_save_killed_midway_leaves_no_partial_file(tmp_path):
    path = tmp_path / "llm.pt"
    code = ("import sys, time, torch\nfrom ttsrl.atomic import atomic_torch_save\n"
            "class Slow:\n"
            "    def __reduce__(self):\n"
            "        print('pickling', flush=True); time.sleep(600)\n"
            f"atomic_torch_save({{'w': torch.zeros(1 << 16), 'slow': Slow()}}, {str(path)!r})\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "pickling"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    temps = list(tmp_path.iterdir())
    assert not path.exists() and len(temps) == 1 and temps[0].name.startswith(".llm.tmp-")
    assert remove_stale_temps(tmp_path) == temps and not any(tmp_path.iterdir())
