"""The README and docs/*.md name only what exists.

Every repository path they name (``ttsrl/...``, ``scripts/...``, ``presets/...``,
``benchmarks/...``, ``tests/...``, ``docs/...``, a bare ``name.py`` meaning a top-level
file), every ``ttsrl.x.y`` module (and the attribute after it), every run.sh stage
(``bash run.sh A B``, "stage N", the README's stage table against the launcher's STAGES) and every
link to a docs page and its heading must resolve in this checkout. The README stays a
manual: under 260 lines, linking every docs page.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
PREFIXES = ("ttsrl/", "scripts/", "presets/", "benchmarks/", "tests/", "docs/")

TOKEN = re.compile(r"(?<![\w./$-])[\w.{},*/-]+")
MODULE = re.compile(r"(?<![\w./-])ttsrl(?:\.\w+)+")
RUN_SH = re.compile(r"\brun\.sh((?:[ \t]+-?\d+){1,2})\b")
STAGE_WORD = re.compile(r"\b[Ss]tages?[ \t]+(-?\d+)")
LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#([^)\s]+))?\)")


def run_sh_stages() -> list[str]:
    """The stages run.sh accepts (the launcher's STAGES), each of which has its `if stage N` block."""
    from ttsrl.launch.settings import STAGES

    text = (ROOT / "run.sh").read_text()
    for s in STAGES:
        assert re.search(rf"^if stage {s}\b", text, re.M), f"run.sh has no `if stage {s}` block"
    return [str(s) for s in STAGES]


def expand_braces(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [x for alt in m.group(1).split(",") for x in expand_braces(path[: m.start()] + alt + path[m.end():])]


def path_exists(path: str, root: Path) -> bool:
    if "*" in path:
        return any(root.glob(path))
    return (root / path).exists()


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    bad = []
    for raw in TOKEN.findall(text):
        tok = raw.rstrip(".,;:")
        if tok.startswith(PREFIXES):
            pass
        elif "/" not in tok and tok.endswith(".py") and not tok.startswith("."):
            pass  # a bare name.py: a top-level file
        else:
            continue
        bad += [p for p in expand_braces(tok) if not path_exists(p, root)]
    return bad


def module_resolves(dotted: str, root: Path) -> bool:
    parts = dotted.split(".")
    here = root
    for i, part in enumerate(parts):
        if (here / part).is_dir():
            here = here / part
            continue
        file = here / f"{part}.py"
        if not file.is_file():
            return False
        rest = parts[i + 1:]
        if not rest:
            return True
        name = re.escape(rest[0])
        return bool(re.search(rf"^\s*(?:async\s+def|def|class)\s+{name}\b|^\s*{name}\s*[:=]",
                              file.read_text(), re.M))
    return (here / "__init__.py").is_file()


def missing_modules(text: str, root: Path = ROOT) -> list[str]:
    return [m.rstrip(".") for m in MODULE.findall(text) if not module_resolves(m.rstrip("."), root)]


def unknown_stages(text: str, stages: list[str]) -> list[str]:
    found = [n for m in RUN_SH.finditer(text) for n in m.group(1).split()]
    found += STAGE_WORD.findall(text)
    return [s for s in found if s not in stages]


def broken_links(doc: Path, text: str) -> list[str]:
    bad = []
    for target, anchor in LINK.findall(text):
        if "://" in target:
            continue
        page = (doc.parent / target).resolve()
        if not page.is_file():
            bad.append(target)
        elif anchor and anchor not in heading_slugs(page.read_text()):
            bad.append(f"{target}#{anchor}")
    return bad


def heading_slugs(text: str) -> set[str]:
    """GitHub's anchors: lower case, punctuation dropped, spaces -> hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_and_modules_exist(doc):
    text = doc.read_text()
    assert missing_paths(text) == [], f"{doc.name} names paths that do not exist"
    assert missing_modules(text) == [], f"{doc.name} names ttsrl modules that do not exist"
    assert broken_links(doc, text) == [], f"{doc.name} links to missing pages or headings"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_stages_are_run_sh_stages(doc):
    assert unknown_stages(doc.read_text(), run_sh_stages()) == [], f"{doc.name}: stages run.sh lacks"


def test_readme_stage_table_is_run_sh_stages():
    section = README.read_text().split("\n## Stages", 1)[-1].split("\n## ", 1)[0]  # not the code map's layers
    rows = re.findall(r"^\| *(-?\d+) *\|", section, re.M)
    assert rows, "README has no stage table"
    assert set(rows) == set(run_sh_stages())


def test_readme_is_a_manual():
    text = README.read_text()
    assert len(text.splitlines()) < 260
    linked = {Path(t).name for t, _ in LINK.findall(text) if t.startswith("docs/")}
    assert {p.name for p in DOCS[1:]} <= linked, "every docs page is linked from the README"


def test_checks_catch_what_they_should(tmp_path):
    (tmp_path / "ttsrl" / "model").mkdir(parents=True)
    (tmp_path / "ttsrl" / "__init__.py").write_text("")
    (tmp_path / "ttsrl" / "model" / "__init__.py").write_text("")
    (tmp_path / "ttsrl" / "model" / "vocab.py").write_text("SPEECH = 1\n\ndef ids():\n    pass\n")
    (tmp_path / "run_me.py").write_text("")
    good = ("`ttsrl/model/vocab.py`, `ttsrl/{model,model/vocab.py}`, `ttsrl/model/*.py` and "
            "`run_me.py`; `ttsrl.model.vocab.ids`, ttsrl.model.vocab.SPEECH. `$EXP_DIR/ttsrl/x.py`, "
            "`upstream/gone.py`.")
    assert missing_paths(good, tmp_path) == []
    assert missing_modules(good, tmp_path) == []
    bad = "see ttsrl/sim.py, `ttsrl/{model,data}/`, gone.py and `ttsrl/model/*.txt`."
    assert missing_paths(bad, tmp_path) == ["ttsrl/sim.py", "ttsrl/data/", "gone.py", "ttsrl/model/*.txt"]
    assert missing_modules("ttsrl.records, ttsrl.model.vocab.nothing and ttsrl.model.gone",
                           tmp_path) == ["ttsrl.records", "ttsrl.model.vocab.nothing", "ttsrl.model.gone"]
    stages = ["-2", "-1", "0", "1"]
    assert unknown_stages("bash run.sh -1 1, stage 0, stages -2..1", stages) == []
    assert unknown_stages("bash run.sh 0 7; Stage 9 and bash run.sh 6", stages) == ["7", "6", "9"]
    doc = tmp_path / "README.md"
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n## DPO / KTO (embedded)\n")
    links = "[a](docs/a.md#dpo--kto-embedded) [b](docs/b.md) [c](docs/a.md#nope) [w](https://x.org/a.md)"
    assert broken_links(doc, links) == ["docs/b.md", "docs/a.md#nope"]


def docker_run_commands(text: str) -> list[list[str]]:
    """The words of every `docker run ...` command in a doc or a Dockerfile's comments
    (backslash-continued lines joined)."""
    text = re.sub(r"^#[ \t]?", "", text, flags=re.M)  # a Dockerfile's comment lines
    text = re.sub(r"\\\n[ \t]*", " ", text)
    return [shlex.split(m.group(0).rstrip("`").strip()) for m in re.finditer(r"docker run [^\n`]*", text)]


def preset_paths(preset: Path) -> dict[str, str]:
    """The preset's default input/output locations (`: "${VAR:=value}"`), relative to the checkout."""
    return {k: v for k, v in re.findall(r'^: "\$\{(\w+):=([^}]*)\}"', preset.read_text(), re.M)
            if k.endswith(("_DIR", "_FILE")) and v and not v.startswith("/")}


@pytest.mark.parametrize("doc", [ROOT / "Dockerfile", ROOT / "docs" / "gpu.md"], ids=lambda p: p.name)
def test_documented_docker_run_is_the_gpu_recipe(doc):
    """The Dockerfile's example ran `bash run.sh -1 5` without PRESET, i.e. the
    embedded CPU preset, with no data folder mounted and Docker's 64 MB /dev/shm. The
    documented command runs presets/gpu8.sh on all GPUs, with a real /dev/shm (Ray's object
    store, NCCL) and every folder the preset reads or writes mounted into the image."""
    workdir = re.search(r"^WORKDIR\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M).group(1)
    paths = preset_paths(ROOT / "presets" / "gpu8.sh")
    assert {"COSYVOICE2_DIR", "TRAIN_FILE", "PROMPT_DIR", "SEEDTTS_ZH_DIR", "EXP_DIR"} <= set(paths), paths
    commands = docker_run_commands(doc.read_text())
    assert commands, f"{doc.name} shows no docker run command"
    for words in commands:
        line = " ".join(words)
        assert "PRESET=presets/gpu8.sh" in words, line
        assert (ROOT / "presets" / "gpu8.sh").is_file()
        assert "--gpus" in words and words[words.index("--gpus") + 1] == "all", line
        assert any(w.startswith("--shm-size") for w in words), line
        assert "run.sh" in words, line
        mounts = [words[i + 1].split(":")[1] for i, w in enumerate(words[:-1]) if w in ("-v", "--volume")]
        unmounted = {k: v for k, v in paths.items()
                     if not any(f"{workdir}/{v}".startswith(m.rstrip("/") + "/") for m in mounts)}
        assert not unmounted, f"{doc.name}: {line}\n  the preset's paths not under a mount: {unmounted}"


def test_operations_describes_the_step_rule_for_lost_rewards_with_the_codes_names():
    """docs/operations.md says the rule for lost rewards: the share allowed (the knob and its default), where
    it is shown (the console line, the metric keys, the run record's key) and when the run stops; each
    name is the code's own, so a rename shows here."""
    from ttsrl import knobs
    from ttsrl.console import GROUPS_DROPPED_KEY, NO_REWARD_KEY
    from ttsrl.verl_plugin import reward_metrics as R

    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    section = text.split("### Lost rewards: the step rule", 1)[1].split("\n## ", 1)[0]
    default = knobs.KNOBS[R.LIMIT_KNOB].default
    assert f"`{R.LIMIT_KNOB}` (default {default:g}" in section
    for name in (R.NO_REWARD, R.GROUPS_DROPPED, NO_REWARD_KEY, GROUPS_DROPPED_KEY, R.HEALTH_KEY, R.RUN_RECORD,
                 "RewardHealthError"):
        assert f"`{name}`" in section or f"/{name}`" in section, name
    assert "no reward 0%  groups dropped 0%" in section and "before that\n  step trains" in section
