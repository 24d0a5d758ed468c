"""run.sh honours its stage range and rejects bad arguments (the reference's
run.sh ignored its stage arguments)."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_sh(*args, env=None):
    return subprocess.run(["bash", str(ROOT / "run.sh"), *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=300)


def test_help_and_bad_ranges():
    r = run_sh("--help")
    assert r.returncode == 0 and "bash run.sh START STOP" in r.stdout
    for bad in (["3", "1"], ["-3", "0"], ["0", "6"], ["x", "1"]):
        r = run_sh(*bad)
        assert r.returncode == 2, (bad, r.stdout, r.stderr)


def test_only_the_requested_stage_runs(tiny_cosyvoice2, tmp_path):
    import os

    exp = tmp_path / "exp"
    preset = tmp_path / "preset.sh"
    base = (ROOT / "presets" / "embedded.sh").read_text()
    preset.write_text(base + f"\nEXP_DIR={exp}\nBUILD_BASE_MODEL=0\nCOSYVOICE2_DIR={tiny_cosyvoice2[0]}\n"
                      f"HF_MODEL_DIR={exp}/hf_model\nDATA_DIR={exp}/data\n")
    r = run_sh("-1", "-1", env={**os.environ, "PRESET": str(preset)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "==== stage -1" in r.stdout and "==== stage 0" not in r.stdout
    assert (exp / "hf_model" / "config.json").is_file()
    assert not (exp / "data").exists()  # stage 0 was not in the range
