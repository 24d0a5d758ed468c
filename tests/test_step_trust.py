"""A merged step is trusted only when its files hash as its marker records,
and a step the sweep leaves out is named."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ttsrl.model.checkpoint import MARKER, check_merged, merged_steps, write_marker
from ttsrl.train.steps import model_dir_for

ROOT = Path(__file__).resolve().parents[1]


def corrupt(path: Path, offset_from_end: int = 4096, n: int = 256) -> None:
    """Overwrite ``n`` bytes inside the tensor data: the size stays the same."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size - offset_from_end)
        f.write(bytes(255 - b for b in f.read(n)))
        f.seek(size - offset_from_end)


@pytest.fixture
def merged(tiny_hf, tmp_path):
    """MERGED/step_5: the tiny converted model with a marker, as stage 3 or DPO leave it."""
    d = tmp_path / "merged"
    step = d / "step_5"
    shutil.copytree(tiny_hf, step)
    write_marker(step, {"step": 5, "source": "test"})
    return d


def test_a_step_with_256_corrupted_bytes_of_the_right_size_is_not_trusted(merged, capsys):
    step = merged / "step_5"
    assert check_merged(step) is None
    weights = next(step.glob("*.safetensors"))
    size = weights.stat().st_size
    corrupt(weights)
    assert weights.stat().st_size == size
    why = check_merged(step)
    assert why and "sha256" in why and weights.name in why
    # stage 4 leaves it out and says so; stage 5 refuses it by number
    assert merged_steps(merged) == {}
    assert "step_5 left out" in capsys.readouterr().out
    with pytest.raises(ValueError, match="sha256"):
        model_dir_for(5, merged, merged)


def test_stage5_refuses_to_export_a_corrupted_step(merged, tiny_hf, tmp_path):
    weights = next((merged / "step_5").glob("*.safetensors"))
    corrupt(weights)
    summary = tmp_path / "summary.json"
    # a sweep whose dev set chooses step 5 (stage 5 chooses on dev rows only)
    summary.write_text(json.dumps([{"step": s, "test_set": "dev", "role": "dev", "headline": "cer_utt_mean",
                                    "cer_utt_mean": c, "cer": c} for s, c in ((0, 0.5), (5, 0.1))]))
    out = tmp_path / "llm-new.pt"
    for args in (["--from-sweep", str(summary), "--merged-dir", str(merged), "--start-model", str(tiny_hf)],
                 ["--hf-cosyvoice2-llm-path", str(merged / "step_5")]):
        proc = subprocess.run([sys.executable, str(ROOT / "huggingface_to_pretrained.py"), *args,
                               "--output-path", str(out), "--verify"], capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "sha256" in proc.stderr and not out.exists()


def test_a_marker_without_hashes_is_not_trusted(merged):
    step = merged / "step_5"
    info = json.loads((step / MARKER).read_text())
    for rec in info["files"].values():
        rec.pop("sha256")
    (step / MARKER).write_text(json.dumps(info))
    assert "records no sha256" in check_merged(step)


def test_stage3_does_not_skip_a_corrupted_step(merged, tmp_path):
    """Stage 3's skip trusts the same check: a corrupted step_N is merged again."""
    from ttsrl.train.merge import source_to_merge

    (merged / "step_5" / MARKER).unlink()
    write_marker(merged / "step_5", {"step": 5, "dtype_option": "auto"})  # as stage 3 writes it
    corrupt(next((merged / "step_5").glob("*.safetensors")))
    actor = tmp_path / "ckpt" / "global_step_5" / "actor"
    actor.mkdir(parents=True)
    lines = []
    assert source_to_merge(5, actor, merged, "auto", log=lines.append) is not None
    assert any("sha256" in m and "merging again" in m for m in lines), lines
