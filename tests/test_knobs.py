"""ttsrl.knobs: every TTSRL_* environment variable of the repository is declared there, once,
and Python code reads them only through it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ttsrl import knobs

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"TTSRL_[A-Z0-9_]*[A-Z0-9]")
DIRECT_READ = re.compile(r"""(os\.environ\.get\(|os\.getenv\(|os\.environ\[)\s*["']TTSRL_""")


def repository_files() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / p for p in tracked if (ROOT / p).is_file() and not p.endswith((".parquet", ".pt", ".png", ".wav"))
            and p != "tests/test_knobs.py"]  # this file names a knob that must not exist


def texts():
    for path in repository_files():
        try:
            yield path, path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue


def test_every_name_in_the_repository_is_declared_and_every_declared_one_is_used():
    used: dict[str, set[str]] = {}
    for path, text in texts():
        for name in NAME.findall(text):
            used.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    assert len(used) >= 19
    undeclared = {n: sorted(p) for n, p in used.items() if n not in knobs.KNOBS}
    assert not undeclared, f"declare these in ttsrl/knobs.py: {undeclared}"
    unused = [n for n in knobs.KNOBS if used.get(n, set()) <= {"ttsrl/knobs.py"}]
    assert not unused, f"declared in ttsrl/knobs.py but read nowhere: {unused}"


def test_python_reads_knobs_only_through_the_module():
    direct = [f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}"
              for path, text in texts() if path.suffix == ".py" and path.name != "knobs.py"
              for m in DIRECT_READ.finditer(text)]
    assert not direct, f"read these through ttsrl.knobs.get: {direct}"


def test_values_are_typed_with_declared_defaults():
    env = {"TTSRL_REWARD_RETRIES": "9", "TTSRL_ALLOW_VERL_MISMATCH": "1", "TTSRL_CACHE_DIR": "~/c",
           "TTSRL_HF_ROLLOUT_BATCH_WINDOW_S": ""}
    assert knobs.get("TTSRL_REWARD_RETRIES", env) == 9
    assert knobs.get("TTSRL_ALLOW_VERL_MISMATCH", env) is True
    assert knobs.get("TTSRL_ALLOW_VERL_MISMATCH", {}) is False
    assert knobs.get("TTSRL_CACHE_DIR", env) == Path.home() / "c"
    assert knobs.get("TTSRL_CACHE_DIR", {}) == Path.home() / ".cache" / "ttsrl"
    assert knobs.get("TTSRL_HF_ROLLOUT_BATCH_WINDOW_S", env) == 0.05  # empty = unset
    assert knobs.get("TTSRL_REWARD_URL", {}) is None  # the reader's default (the protocol's URL)


def test_unknown_and_malformed_knobs_raise():
    with pytest.raises(KeyError, match="unknown knob 'TTSRL_REWARD_RETRY'"):
        knobs.get("TTSRL_REWARD_RETRY")
    with pytest.raises(ValueError, match="TTSRL_REWARD_RETRIES='many' is not a valid int"):
        knobs.get("TTSRL_REWARD_RETRIES", {"TTSRL_REWARD_RETRIES": "many"})
    with pytest.raises(ValueError, match="TTSRL_PLUGIN_LOADED_LOG='maybe'"):
        knobs.get("TTSRL_PLUGIN_LOADED_LOG", {"TTSRL_PLUGIN_LOADED_LOG": "maybe"})


def test_the_reward_client_reads_its_knobs():
    from ttsrl.reward.client import RewardClientConfig
    from ttsrl.reward.protocol import DEFAULT_URL

    assert RewardClientConfig().retries == 4 and RewardClientConfig().timeout_s == 300.0
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TTSRL_REWARD_RETRIES", "2")
        m.setenv("TTSRL_REWARD_URL", "http://h:1/")
        m.delenv("TTSRL_REWARD_MODEL", raising=False)
        cfg = RewardClientConfig.from_env()
        assert (cfg.retries, cfg.url, cfg.max_connections) == (2, "http://h:1", 256)
        m.delenv("TTSRL_REWARD_URL")
        assert RewardClientConfig.from_env().url == DEFAULT_URL


def test_the_table_lists_every_knob():
    out = subprocess.run([sys.executable, "-m", "ttsrl.knobs"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    rows = out.splitlines()[1:]
    assert [r.split()[0] for r in rows] == list(knobs.KNOBS)
    assert any("scripts/install.sh [shell]" in r for r in rows if r.startswith("TTSRL_USE_PYTHON"))
