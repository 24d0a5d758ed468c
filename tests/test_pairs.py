"""The pair readers (user JSONL, pairs Parquet, mining) refuse the same rows with the
same FILE:LINE messages, with the limits of ttsrl.limits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from helpers import ROOT

from ttsrl.limits import MAX_SPEECH_CODES, MAX_TEXT_CHARS
from ttsrl.train.pairs import Pair, PairsError, read_pairs, read_user_pairs, write_pairs

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TQDM_DISABLE="1")
GOOD = {"id": "a", "text": "你好", "chosen": [1, 2, 3], "rejected": [4, 5]}


def pair(lm, key="a", text="你好", chosen=(1, 2, 3), rejected=(4, 5), prompt=None, cr=0.9, rr=0.1):
    sv = lm.vocab
    prompt = prompt or [sv.sos_id] + lm.tokenizer.encode(text, add_special_tokens=False) + [sv.task_id]
    return Pair(key, text, prompt, list(chosen), list(rejected), cr, rr)


def test_parquet_reader_refuses_what_the_jsonl_reader_refuses(lm, tmp_path):
    f = tmp_path / "pairs.parquet"

    def expect(pairs, msg):
        write_pairs(pairs, f)
        with pytest.raises(PairsError, match=msg):
            read_pairs(f, lm.vocab)

    sv = lm.vocab
    expect([pair(lm, chosen=[1, 2], rejected=[1, 2])], rf"{f}: row 0: 'chosen' and 'rejected' are the same")
    expect([pair(lm), pair(lm)], rf"{f}: row 1: id 'a' already used at {f}: row 0")
    expect([pair(lm, chosen=[1] * 100_000)], f"row 0: 'chosen' has 100000 speech codes, more than the limit of "
                                             f"{MAX_SPEECH_CODES}")
    expect([pair(lm, text="好" * 200_000, prompt=[sv.sos_id, 5, sv.task_id])],
           f"row 0: 'text': text has 200000 characters, more than the limit of {MAX_TEXT_CHARS}")
    expect([pair(lm, prompt=[sv.sos_id, 10 ** 9, sv.task_id])], "row 0: prompt_ids holds id 1000000000, outside")
    expect([pair(lm, prompt=[sv.sos_id, sv.sos_id, sv.task_id])], "row 0: prompt_ids holds id")
    expect([pair(lm, cr=0.1, rr=0.9)], "row 0: chosen_reward 0.1 is below rejected_reward 0.9")


def test_parquet_reader_names_a_truncated_or_foreign_file(lm, tmp_path):
    f = write_pairs([pair(lm)], tmp_path / "pairs.parquet")
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(PairsError, match="not a readable Parquet file"):
        read_pairs(f, lm.vocab)
    f.write_text(json.dumps(GOOD) + "\n")
    with pytest.raises(PairsError, match="not a readable Parquet file"):
        read_pairs(f, lm.vocab)
    (tmp_path / "t.parquet").write_bytes(b"")
    with pytest.raises(PairsError, match="not a readable Parquet file"):
        read_pairs(tmp_path / "t.parquet", lm.vocab)
    pq.write_table(pq.read_table(write_pairs([pair(lm)], tmp_path / "ok.parquet")).drop(["text"]), f)
    with pytest.raises(PairsError, match="missing column"):
        read_pairs(f, lm.vocab)


def write_lines(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x, ensure_ascii=False)) + "\n"
                            for x in lines), encoding="utf-8")
    return path


def test_user_pairs_limits_special_token_names_and_null_id(lm, tmp_path):
    f = tmp_path / "u.jsonl"

    def expect(lines, msg):
        write_lines(f, lines)
        with pytest.raises(PairsError, match=msg):
            read_user_pairs(f, lm.tokenizer)

    expect([{**GOOD, "chosen": [1] * 100_000}], rf"{f}:1: 'chosen' has 100000 speech codes, more than the limit")
    expect([{**GOOD, "text": "好" * 200_000}], rf"{f}:1: 'text': text has 200000 characters, more than the limit")
    for name in ("<|s_12|>", "<|sos|>", "<|task_id|>"):
        expect([{**GOOD, "text": f"你好{name}再见"}], rf"{f}:1: 'text' holds '{name[:3]}.*a token of the speech vocabulary")
    expect([{**GOOD, "text": "第〡名"}], r"U\+3021")
    expect([{**GOOD, "id": [1]}], rf"{f}:1: 'id' must be a string or an integer")
    write_lines(f, [{**GOOD, "id": None}, {**GOOD, "id": None, "chosen": [9]}, {**GOOD, "id": 7}])
    assert [p.key for p in read_user_pairs(f, lm.tokenizer)] == ["pair_000001", "pair_000002", "7"]


@pytest.mark.parametrize("kind", ["missing", "folder", "binary", "latin1", "nested", "surrogate", "empty"])
def test_user_pairs_file_problems_are_messages_not_tracebacks(lm, tmp_path, kind):
    f = tmp_path / "u.jsonl"
    if kind == "folder":
        f.mkdir()
    elif kind == "binary":
        f.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)  # a PNG header: not UTF-8
    elif kind == "latin1":
        f.write_bytes(json.dumps({**GOOD, "text": "café"}, ensure_ascii=False).encode("latin-1") + b"\n")
    elif kind == "nested":
        f.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    elif kind == "surrogate":
        f.write_text('{"text": "\\ud800", "chosen": [1], "rejected": [2]}\n')
    elif kind == "empty":
        f.write_text("")
    with pytest.raises(PairsError) as err:
        read_user_pairs(f, lm.tokenizer)
    assert str(f) in str(err.value)
    msg = {"missing": "no such file", "folder": "is a directory", "binary": "not valid UTF-8",
           "latin1": "not valid UTF-8", "nested": "nested too deeply", "surrogate": "lone UTF-16 surrogate",
           "empty": "file is empty"}[kind]
    assert msg in str(err.value)


def mine(lm, *args):
    cli = [sys.executable, str(ROOT / "mine_pairs.py"), "--model", str(lm.model.config._name_or_path), *args]
    return subprocess.run(cli, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)


@pytest.mark.slow  # mine_pairs.py round trips: ~8 s
def test_mine_pairs_options_are_checked(lm, tmp_path):
    texts = write_lines(tmp_path / "texts.jsonl", [{"text": "你好"}, {"text": "再见"}])
    users = write_lines(tmp_path / "u.jsonl", [GOOD])
    out = str(tmp_path / "out.parquet")
    for args, msg in ((["--texts", str(texts), "--limit", "-1"], "--limit must be at least 1"),
                      (["--texts", str(texts), "--min-margin", "nan"], "--min-margin must be a finite number"),
                      (["--user-pairs", str(users), "--k", "3"], "--k apply to mining (--texts) only"),
                      (["--user-pairs", str(users), "--limit", "1", "--min-margin", "0.2"],
                       "--min-margin, --limit apply to mining")):
        r = mine(lm, *args, "--out", out)
        assert r.returncode == 2 and msg in r.stderr, (args, r.stderr[-1500:])
        assert "Traceback" not in r.stderr


@pytest.mark.slow  # a mine_pairs.py round trip: ~8 s
def test_mining_reports_the_reward_servers_real_error(lm, tmp_path):
    texts = write_lines(tmp_path / "texts.jsonl", [{"text": "你好"}])
    r = subprocess.run([sys.executable, str(ROOT / "mine_pairs.py"), "--model", str(lm.model.config._name_or_path),
                        "--texts", str(texts), "--out", str(tmp_path / "o.parquet"), "--k", "2",
                        "--reward-url", "http://127.0.0.1:9", "--max-token-text-ratio", "3", "--threads", "1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**ENV, "TTSRL_REWARD_RETRIES": "0"})
    assert r.returncode == 1, r.stderr[-2000:]
    # the pool's error names every server with its own last error (here the one refused connection)
    assert "the last reward error: no reward server could answer" in r.stderr, r.stderr[-2000:]
    assert "http://127.0.0.1:9: ClientConnectorError talking to http://127.0.0.1:9" in r.stderr, r.stderr[-2000:]


@pytest.mark.slow  # train_dpo.py round trips: ~18 s
def test_train_dpo_names_a_bad_pairs_file(lm, tiny_hf, tmp_path):
    """A non-Parquet or truncated --pairs, out-of-vocabulary prompt_ids: a message, rc 2."""
    sv = lm.vocab
    good = write_pairs([pair(lm), pair(lm, key="b")], tmp_path / "good.parquet")
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[:200])
    oov = write_pairs([pair(lm, prompt=[sv.sos_id, 10 ** 9, sv.task_id])], tmp_path / "oov.parquet")
    for f, msg in ((cut, "not a readable Parquet file"), (oov, "prompt_ids holds id 1000000000, outside")):
        r = subprocess.run([sys.executable, str(ROOT / "train_dpo.py"), "--model", str(tiny_hf), "--pairs", str(f),
                            "--out-dir", str(tmp_path / "out"), "--max-steps", "1", "--threads", "1"],
                           capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
        assert r.returncode == 2 and msg in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr and not list((tmp_path / "out").glob("step_*"))
