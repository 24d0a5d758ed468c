"""One option mechanism for every CLI: settings are dataclass fields declared
with ``ttsrl.cli.option`` and their choices come from the registries (``REWARDS``, the backends,
``ALGORITHMS``, the sampling rules), never from a hand-written list that can drift."""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import huggingface_to_pretrained  # noqa: E402
import infer_dataset  # noqa: E402
import merge_checkpoints  # noqa: E402
import mine_pairs  # noqa: E402
import prepare_data  # noqa: E402
import token2wav_asr_server  # noqa: E402
import train_dpo  # noqa: E402
import train_grpo  # noqa: E402
from ttsrl.cli import add_fields, given  # noqa: E402
from ttsrl.data.prepare import PrepareConfig  # noqa: E402
from ttsrl.eval.compare import CompareRuns  # noqa: E402
from ttsrl.model.cosyvoice_lm import SAMPLING_RULES  # noqa: E402
from ttsrl.reward.backends import ASRS, BACKENDS  # noqa: E402
from ttsrl.reward.rewards import REWARDS  # noqa: E402
from ttsrl.train.algorithms import ALGORITHMS  # noqa: E402
from ttsrl.train.merge import MergeConfig, MergeWorker  # noqa: E402

#: every CLI's parser, built as the CLI builds it
PARSERS = {"token2wav_asr_server.py": token2wav_asr_server.parser, "infer_dataset.py": infer_dataset.parser,
           "mine_pairs.py": mine_pairs.parser, "huggingface_to_pretrained.py": huggingface_to_pretrained.parser,
           "train_dpo.py": train_dpo.parser, "train_grpo.py": train_grpo._parser,
           "merge_checkpoints.py": merge_checkpoints.parser, "ttsrl/eval/compare.py": lambda: fields_parser(CompareRuns)}

def fields_parser(cls) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_fields(p, cls)
    return p


#: option -> the registry its choices must be
REGISTRIES = {"--reward": lambda: tuple(REWARDS), "--backend": lambda: BACKENDS, "--reward-backend": lambda: BACKENDS,
              "--asr": lambda: ASRS, "--algorithm": lambda: tuple(ALGORITHMS), "--sampling-rule": lambda: SAMPLING_RULES}

#: the CLIs (and the modules declaring their options) converted to ttsrl.cli: no hand-written option
CONVERTED = ("token2wav_asr_server.py", "ttsrl/reward/server.py", "ttsrl/reward/backends/options.py",
             "ttsrl/reward/backends/__init__.py", "infer_dataset.py", "ttsrl/eval/evaluate.py",
             "ttsrl/model/generate.py", "mine_pairs.py", "ttsrl/train/pairs.py", "huggingface_to_pretrained.py",
             "train_dpo.py", "ttsrl/model/cosyvoice_lm.py", "ttsrl/reward/health.py", "reward_tts.py",
             "pretrained_to_huggingface.py", "merge_checkpoints.py", "ttsrl/train/merge.py", "ttsrl/data/devsplit.py",
             "ttsrl/eval/compare.py", "ttsrl/console.py", "build_base_model.py", "ttsrl/embedded/pretrain.py",
             "prepare_data.py", "ttsrl/data/prepare.py")

#: CLIs that still hand-write argparse options (to convert; none may be added). ttsrl/cli.py is the
#: mechanism itself; ttsrl/launch/ is being written.
NOT_YET = {"train_grpo.py", "ttsrl/train/nodes.py"}


def hand_written_options(path: Path) -> list[int]:
    """Lines of ``path`` that call ``.add_argument(...)`` or make a mutually exclusive group."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("add_argument", "add_mutually_exclusive_group")]


def options(parser) -> dict:
    return {s: a for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize("cli", sorted(PARSERS))
def test_choices_come_from_the_registries(cli):
    for flag, action in options(PARSERS[cli]()).items():
        if flag in REGISTRIES:
            assert tuple(action.choices) == REGISTRIES[flag](), (cli, flag)


def test_the_server_and_stage_4_offer_every_reward_and_backend():
    for cli in ("token2wav_asr_server.py", "infer_dataset.py"):
        opts = options(PARSERS[cli]())
        assert tuple(opts["--reward"].choices) == tuple(REWARDS) and "exp_toneless" in opts["--reward"].choices
        assert tuple(opts["--backend"].choices) == BACKENDS


def test_a_reward_registered_later_is_a_choice_of_every_cli(monkeypatch):
    """The choices are read from REWARDS when a parser is built, not copied at import."""
    monkeypatch.setitem(REWARDS, "my_reward", REWARDS["tanh"])
    assert token2wav_asr_server.parse_args(["--reward", "my_reward"]).reward == "my_reward"
    argv = ["--start-model", "m", "--out-dir", "o", "--test-set", "t=x.jsonl", "--reward", "my_reward"]
    assert infer_dataset.parse_args(argv).reward == "my_reward"
    import train_grpo  # stage 2 takes it too: GRPOConfig.reward's choices are REWARDS itself

    grpo = ["--model-path", "/m", "--train-files", "/t", "--val-files", "/v", "--reward", "my_reward"]
    assert train_grpo.build(grpo).config.reward == "my_reward"


@pytest.mark.parametrize("path", CONVERTED)
def test_converted_clis_hand_write_no_option(path):
    assert hand_written_options(ROOT / path) == [], f"{path}: declare the option as a field with ttsrl.cli.option"


def test_no_new_cli_hand_writes_options():
    files = [*ROOT.glob("*.py"), *(ROOT / "ttsrl").rglob("*.py")]
    hand = {str(p.relative_to(ROOT)) for p in files if hand_written_options(p)}
    hand = {p for p in hand if not p.startswith("ttsrl/launch/")} - {"ttsrl/cli.py"}
    assert hand <= NOT_YET, f"declare these options with ttsrl.cli.option: {sorted(hand - NOT_YET)}"


def test_flags_kept_their_names_and_meanings(tmp_path):
    """The flags scripts, presets and docs use still parse to what they meant."""
    cfg = token2wav_asr_server.parse_args(["--backend", "sim", "--reward", "exp_toneless", "--no-length-guard",
                                           "--want-sim", "--sim-weight", "0.1", "--devices", "cpu,cpu", "--port", "0",
                                           "--max-batch", "4", "--cpu-threads", "2", "--log-level", "WARNING",
                                           "--mos-weight", "0.2"])
    assert (cfg.reward, cfg.length_guard, cfg.want_sim, cfg.sim_weight, cfg.devices, cfg.max_batch) == \
        ("exp_toneless", False, True, 0.1, ("cpu", "cpu"), 4)
    assert (cfg.mos_weight, token2wav_asr_server.parse_args([]).mos_weight) == (0.2, 0.0)
    assert (cfg.backend.backend, cfg.backend.cpu_threads, token2wav_asr_server.parse_args([]).length_guard) == \
        ("sim", 2, True)
    argv = ["--start-model", "m", "--out-dir", "o", "--test-set", "a=x.jsonl", "--test-set", "b=y,z.jsonl",
            "--no-wavs", "--force", "--greedy", "--steps", "0,2", "--threads", "3", "--node-share", "0/2"]
    ev = infer_dataset.parse_args(argv)
    assert ev.test_sets == [("a", "x.jsonl"), ("b", "y,z.jsonl")]  # repeated, never split at commas
    assert (ev.save_wavs, ev.force, ev.generation.greedy, ev.steps, ev.backend.cpu_threads) == \
        (False, True, True, (0, 2), 3)
    assert str(ev.node_share) == "0/2"
    with pytest.raises(SystemExit):
        infer_dataset.parse_args(["--start-model", "m", "--out-dir", "o", "--test-set", "no-equals-sign"])
    mine = mine_pairs.parse_args(["--model", "m", "--out", "p.parquet", "--texts", "t.jsonl", "--k", "3"])
    assert (mine.k, mine.min_margin, mine.batch_size, mine.user_pairs) == (3, 0.1, 16, None)
    zs = mine_pairs.parse_args(["--model", "m", "--out", "p.parquet", "--texts", "t.jsonl", "--prompt-pool", "d",
                                "--prompt-rows", "train.parquet"])
    assert (zs.prompt_pool, zs.prompt_rows) == ("d", "train.parquet")
    for bad in ([], ["--texts", "t.jsonl", "--user-pairs", "u.jsonl"],  # exactly one source
                ["--texts", "t.jsonl", "--prompt-pool", "d"], ["--texts", "t.jsonl", "--prompt-rows", "r"]):  # together
        with pytest.raises(SystemExit):
            mine_pairs.parse_args(["--model", "m", "--out", "p.parquet", *bad])
    merge = MergeConfig(**given(merge_checkpoints.parser().parse_args(
        ["--ckpt-dir", "c", "--out-dir", "o", "--steps", "2", "4", "--dtype", "fp32", "--use-checkpoint-code"]),
        MergeConfig))
    assert (merge.ckpt_dir, merge.steps, merge.dtype, merge.use_checkpoint_code, merge.base_model) == \
        (Path("c"), [2, 4], "fp32", True, None)
    worker = argparse.ArgumentParser()  # the command merge_all gives its worker
    add_fields(worker, MergeWorker)
    w = given(worker.parse_args(["--jobs", "[]", "--dtype", "fp32"]), MergeWorker)
    assert MergeWorker(**w) == MergeWorker("[]", "fp32")
    p = prepare_data.build_parser()
    prep = given(p.parse_args(["--train_file", "a", "--test-file", "b", "--local_dir", "c", "-q", "--skip-invalid",
                               "--max-prompt-length", "64", "--data_source", "x"]), PrepareConfig)
    assert PrepareConfig(**prep) == PrepareConfig(Path("a"), Path("b"), Path("c"), max_prompt_length=64,
                                                  skip_invalid=True, data_source="x", progress=False)
    with pytest.raises(SystemExit) as e:
        huggingface_to_pretrained.main(["--output-path", str(tmp_path / "llm.pt"), "--from-sweep", "s.json"])
    assert e.value.code == 2  # --from-sweep needs --merged-dir and --start-model
