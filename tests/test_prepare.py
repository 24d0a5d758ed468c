"""Stage 0 data preparation: JSON/JSONL text rows -> verl RL Parquet (ttsrl.data.prepare, prepare_data.py).

Everything here runs the real pieces: real files, real Parquet read back with pyarrow,
verl's own RLHFDataset and prompt builder, a real (tiny) tokenizer, the real CLI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import run_main  # tests/helpers.py (tests/ is on sys.path)

from ttsrl.data.prepare import DataError, PrepareConfig, output_schema, prepare
from ttsrl.data.rowchecks import normalise_for_dedup
from ttsrl.jsonl import RecordReader
from ttsrl.model.vocab import extend_tokenizer, vocab_of

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "prepare_data.py"
BAD_FIXTURE = ROOT / "tests" / "fixtures" / "bad_lines.jsonl"
CORPUS = ROOT / "data" / "corpus"

SENTENCES = [
    "今天天气很好。", "我们在2024年3月5日见面。", "重庆的银行行长来了。", "Hello world, 你好世界！",
    "他说：“我明天去北京。”", "一共是三百二十五块钱。", "请把窗户关上。", "我用iPhone拍照。",
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def write_json_array(path: Path, rows: list) -> Path:
    path.write_text(json.dumps(rows, ensure_ascii=False, indent=2), encoding="utf-8")
    return path


def run_prepare(tmp_path: Path, train: list | Path, test: list | Path | None = None, **kw):
    """prepare() on rows (written as JSONL) or on given files; returns (report, out_dir)."""
    if not isinstance(train, Path):
        train = write_jsonl(tmp_path / "train.jsonl", train)
    if test is None:
        test = [{"text": "测试集的句子。"}]
    if not isinstance(test, Path):
        test = write_jsonl(tmp_path / "test.jsonl", test)
    out = kw.pop("local_dir", tmp_path / "out")
    on_chunk = kw.pop("on_chunk", None)
    cfg = PrepareConfig(train_file=train, test_file=test, local_dir=out, progress=False, **kw)
    return prepare(cfg, on_chunk=on_chunk), out


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CLI), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A tiny Qwen-style tokenizer with the speech vocabulary and chat template, saved
    like the converted model's folder."""
    from ttsrl.embedded.tiny_tokenizer import save_blank_en, train_tokenizer
    texts = SENTENCES * 4
    if (CORPUS / "train.jsonl").exists():
        texts += [json.loads(line)["text"] for line in (CORPUS / "train.jsonl").read_text().splitlines()
                  if line.strip()]
    tok = train_tokenizer(texts, vocab_size=400)
    extend_tokenizer(tok, "cosyvoice2")
    out = tmp_path_factory.mktemp("tok")
    save_blank_en(tok, out)
    return out


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tok_dir))


# ---------------------------------------------------------------------------
# good input


def test_jsonl_rows_become_verl_schema(tmp_path):
    rows = [
        {"id": "u1", "text": "  今天天气很好。 ", "spk": 3, "score": 1, "meta": {"a": [1, 2]}},
        {"id": "u2", "text": "Hello world, 你好世界！", "score": 2.5, "flag": True},
        {"id": 3, "text": "重庆的银行行长来了。", "tags": ["x", "y"], "flag": False},
    ]
    report, out = run_prepare(tmp_path, rows, data_source="corpus-a", ability="tts")

    table = pq.read_table(out / "train.parquet")
    extra = [pa.field("id", pa.string()), pa.field("spk", pa.int64()), pa.field("score", pa.float64()),
             pa.field("meta", pa.string()), pa.field("flag", pa.bool_()), pa.field("tags", pa.string())]
    assert table.schema.equals(output_schema(extra))
    got = table.to_pylist()
    texts = ["今天天气很好。", "Hello world, 你好世界！", "重庆的银行行长来了。"]
    for i, (row, text) in enumerate(zip(got, texts)):
        assert row["data_source"] == "corpus-a"
        assert row["prompt"] == [{"role": "user", "content": text}]
        assert row["ability"] == "tts"
        assert row["reward_model"] == {"style": "rule", "ground_truth": text}
        assert row["extra_info"] == {"split": "train", "index": i, "text": text}
    # other columns kept: native where one kind, JSON text otherwise, null where missing
    assert [r["id"] for r in got] == ["u1", "u2", "3"]
    assert [r["spk"] for r in got] == [3, None, None]
    assert [r["score"] for r in got] == [1.0, 2.5, None]
    assert [r["flag"] for r in got] == [None, True, False]
    assert json.loads(got[0]["meta"]) == {"a": [1, 2]} and got[1]["meta"] is None
    assert json.loads(got[2]["tags"]) == ["x", "y"]
    # the id column mixes strings and numbers: reported
    warnings = "\n".join(report.warnings())
    assert "column 'id'" in warnings and "str at line 1" in warnings and "int at line 3" in warnings

    test = pq.read_table(out / "test.parquet").to_pylist()
    assert test == [{"data_source": "corpus-a", "prompt": [{"role": "user", "content": "测试集的句子。"}],
                     "ability": "tts",
                     "reward_model": {"style": "rule", "ground_truth": "测试集的句子。"},
                     "extra_info": {"split": "test", "index": 0, "text": "测试集的句子。"}}]


def test_json_array_and_jsonl_give_the_same_parquet(tmp_path):
    rows = [{"text": s, "id": f"u{i}", "n": i} for i, s in enumerate(SENTENCES)]
    a = tmp_path / "a"
    b = tmp_path / "b"
    a.mkdir(), b.mkdir()
    run_prepare(a, write_jsonl(a / "train.jsonl", rows), write_jsonl(a / "test.jsonl", rows[:2]), allow_leak=True)
    run_prepare(b, write_json_array(b / "train.json", rows), write_json_array(b / "test.json", rows[:2]), allow_leak=True)
    for split in ("train", "test"):
        ta = pq.read_table(a / "out" / f"{split}.parquet")
        tb = pq.read_table(b / "out" / f"{split}.parquet")
        assert ta.num_rows == (len(rows) if split == "train" else 2)
        assert ta.equals(tb)


def test_json_array_records_and_lines(tmp_path):
    """A JSON array (read whole) yields its elements with the line each starts on."""
    path = tmp_path / "rows.json"
    path.write_text('\ufeff[\n  {"text": "今天天气很好。",\n   "n": 123456789},\n  12345,\n'
                    '  {"text": "a\\nb"}  ,{"text": "第三"}\n]\n', encoding="utf-8")
    expected = [(2, {"text": "今天天气很好。", "n": 123456789}), (4, 12345), (5, {"text": "a\nb"}),
                (5, {"text": "第三"})]
    got = [(r.line, r.value) for r in RecordReader(path)]
    assert got == expected


def test_prepared_parquet_loads_in_verl_rlhf_dataset_and_renders_sos_text_task(tmp_path, tok_dir,
                                                                               tokenizer, monkeypatch):
    import datasets
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    sv = vocab_of(tokenizer)
    texts = SENTENCES + ["第二行\n有换行"]
    # the longest prompt exactly fills the budget: kept here and by verl's own filter
    budget = max(len(tokenizer.encode(t, add_special_tokens=False)) + 2 for t in texts)
    rows = [{"text": t, "id": f"u{i}"} for i, t in enumerate(texts)]
    report, out = run_prepare(tmp_path, rows, tokenizer=tok_dir, max_prompt_length=budget)
    assert report.scans["train"].max_prompt_tokens == budget
    assert "counted with the tokenizer" in report.length_description

    config = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": budget,
                               "filter_overlong_prompts": True, "filter_overlong_prompts_workers": 1,
                               "truncation": "error", "cache_dir": str(tmp_path / "verl_cache")})
    ds = RLHFDataset(data_files=[str(out / "train.parquet")], tokenizer=tokenizer, config=config)
    assert len(ds) == len(texts)  # verl's filter dropped nothing

    # the rollout renders raw_prompt with verl's Qwen continuous-token builder
    builder = create_continuous_token_builder(tokenizer, hf_model_type="qwen2")
    for i, text in enumerate(texts):
        item = ds[i]
        ids = builder.build_initial_tokens(item["raw_prompt"])
        assert ids == [sv.sos_id] + tokenizer.encode(text, add_special_tokens=False) + [sv.task_id]
        assert item["reward_model"]["ground_truth"] == text
        assert item["extra_info"]["text"] == text and item["index"] == i
        assert item["data_source"] == "ttsrl" and item["id"] == f"u{i}"
    batch = collate_fn([ds[0], ds[1]])
    assert list(batch["index"]) == [0, 1] and batch["dummy_tensor"].shape == (2, 1)

    # one token over the budget: rejected by prepare, as verl would drop it
    with pytest.raises(DataError, match=r"train\.jsonl:\d+: prompt has \d+ tokens, more than "
                                        rf"--max_prompt_length {budget - 1}"):
        run_prepare(tmp_path, rows, tokenizer=tok_dir, max_prompt_length=budget - 1)


def test_tokenizer_without_chat_template_is_refused(tmp_path):
    from ttsrl.embedded.tiny_tokenizer import save_blank_en, train_tokenizer
    tok = train_tokenizer(SENTENCES * 3, vocab_size=300)  # no speech vocab, no template
    save_blank_en(tok, tmp_path / "plain")
    with pytest.raises(DataError, match="no chat template"):
        run_prepare(tmp_path, [{"text": "你好"}], tokenizer=tmp_path / "plain")


def test_template_that_does_not_copy_the_text_is_counted_row_by_row(tokenizer):
    import copy

    from ttsrl.data.rowchecks import TokenizerPromptLength
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}{{ '<|sos|>' + m['content'] + '。' + m['content'] "
                         "+ '<|task_id|>' }}{% endfor %}")
    counter = TokenizerPromptLength(tok)
    assert not counter.batched
    for text, n in zip(SENTENCES, counter.count(SENTENCES)):
        assert n == len(tok.encode(text + "。" + text, add_special_tokens=False)) + 2


def test_estimate_without_tokenizer_is_an_upper_bound(tmp_path, tokenizer):
    from ttsrl.data.rowchecks import EstimatedPromptLength, TokenizerPromptLength
    counter = TokenizerPromptLength(tokenizer)
    assert counter.batched  # our template: <|sos|> text <|task_id|>
    exact = counter.count(SENTENCES)
    estimate = EstimatedPromptLength().count(SENTENCES)
    assert all(e >= x for e, x in zip(estimate, exact))
    assert estimate == [len(s.encode()) + 2 for s in SENTENCES]


# ---------------------------------------------------------------------------
# bad input

BAD_LINES = [
    ('{"text": "缺少括号"', "malformed JSON"),
    ('["一个", "列表"]', "expected a JSON object"),
    ('{"id": "x", "txt": "拼错"}', 'missing field "text"'),
    ('{"text": ""}', 'field "text" is empty'),
    ('{"text": "   "}', 'field "text" is empty'),
    ('{"text": 12345}', 'field "text" must be a string, got a number'),
    ('{"text": null}', 'field "text" must be a string, got null'),
    ('{"text": "？！。"}', "no letter or digit"),
    ('{"text": "好", "prompt": "x"}', "'prompt' clashes with verl's output column"),
    ('{"text": "' + "很长的句子。" * 100 + '"}', "prompt has 1802 tokens, more than --max_prompt_length 1024"),
    # what the reward server refuses, stage 0 refuses (ttsrl.limits)
    ('{"text": "第〡名"}', "U+3021 HANGZHOU NUMERAL ONE) is a number the text normaliser cannot read"),
    ('{"text": "' + "长" * 1001 + '"}', "text has 1001 characters, more than the limit of 1000"),
    ('{"text": "你好<|s_12|>再见"}', "holds '<|s_12|>', a token of the speech vocabulary"),
    ('{"text": "<|task_id|>你好"}', "holds '<|task_id|>', a token of the speech vocabulary"),
]


@pytest.mark.parametrize("line,message", BAD_LINES, ids=[m.split()[0] for _, m in BAD_LINES])
def test_each_kind_of_bad_row_names_file_and_line(tmp_path, line, message):
    train = tmp_path / "train.jsonl"
    train.write_text('{"text": "第一句。"}\n\n' + line + '\n{"text": "第四行。"}\n', encoding="utf-8")
    with pytest.raises(DataError) as err:
        run_prepare(tmp_path, train)
    assert f"{train}:3: " in str(err.value) and message in str(err.value)
    assert "--skip-invalid" in str(err.value)
    assert not (tmp_path / "out").exists()  # nothing written

    report, out = run_prepare(tmp_path, train, skip_invalid=True)
    scan = report.scans["train"]
    assert (scan.invalid.count, scan.rows) == (1, 2)
    assert [p.line for p in scan.invalid.first] == [3]
    assert pq.read_table(out / "train.parquet").column("extra_info").to_pylist() == [
        {"split": "train", "index": 0, "text": "第一句。"}, {"split": "train", "index": 1, "text": "第四行。"}]


def test_invalid_utf8_line(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_bytes('{"text": "好"}\n'.encode() + b'{"text": "\xff\xfe"}\n')
    with pytest.raises(DataError, match=rf"{train}:2: not valid UTF-8"):
        run_prepare(tmp_path, train)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        run_prepare(tmp_path, tmp_path / "nope.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(DataError, match="empty.jsonl: file is empty"):
        run_prepare(tmp_path, empty)
    only_bad = write_jsonl(tmp_path / "bad.jsonl", [{"txt": "x"}])
    with pytest.raises(DataError, match="bad.jsonl: no valid rows"):
        run_prepare(tmp_path, only_bad, skip_invalid=True)


@pytest.mark.parametrize("content,line,message", [
    ('[\n  {"text": "好"},\n  {"text": "坏" "x"}\n]', 3, "malformed JSON"),
    ('[\n  {"text": "好"}\n  {"text": "坏"}\n]', 3, "expected ',' or ']'"),
    ('[\n  {"text": "好"},\n  {"text": "坏"}', 3, "unexpected end of file"),
    ('[{"text": "好"}]\n\n{"text": "多余"}', 3, "unexpected content after the closing ']'"),
])
def test_json_array_syntax_errors_are_fatal_even_when_skipping(tmp_path, content, line, message):
    path = tmp_path / "train.json"
    path.write_text(content, encoding="utf-8")
    for skip in (False, True):
        with pytest.raises(DataError) as err:
            run_prepare(tmp_path, path, skip_invalid=skip)
        assert f"{path}:{line}: {message}" in str(err.value)


def test_json_array_syntax_error_names_its_line(tmp_path):
    path = tmp_path / "big.json"
    with open(path, "w", encoding="utf-8") as f:
        f.write('[\n{"text": "好"},\n{"text": "坏" "id": 1},\n')
        f.write(",\n".join(json.dumps({"text": f"第{i}句"}, ensure_ascii=False) for i in range(5000)))
        f.write("\n]\n")
    with pytest.raises(DataError, match=rf"{path}:3: malformed JSON: Expecting ',' delimiter"):
        list(RecordReader(path))


def test_json_array_element_errors_can_be_skipped(tmp_path):
    path = tmp_path / "train.json"
    path.write_text('[\n  {"text": "好"},\n  "只是字符串",\n  {\n    "text": ""\n  },\n  {"text": "对"}\n]',
                    encoding="utf-8")
    with pytest.raises(DataError) as err:
        run_prepare(tmp_path, path)
    assert f"{path}:3: expected a JSON object" in str(err.value)
    assert f"{path}:4: field \"text\" is empty" in str(err.value)
    report, out = run_prepare(tmp_path, path, skip_invalid=True)
    assert report.scans["train"].invalid.count == 2
    assert pq.read_table(out / "train.parquet").column("reward_model").to_pylist() == [
        {"style": "rule", "ground_truth": "好"}, {"style": "rule", "ground_truth": "对"}]


def test_skip_invalid_counts_kinds_and_lists_first_lines(tmp_path):
    rows = []
    for i in range(60):
        rows.append({"text": f"第{i}句。"} if i % 3 else {"txt": "x"})  # 20 missing
    rows += [{"text": ""}] * 5 + [{"text": 7}] * 2
    report, _ = run_prepare(tmp_path, rows, skip_invalid=True, max_listed=4)
    scan = report.scans["train"]
    assert scan.invalid.count == 27 and scan.rows == 40
    assert dict(scan.invalid_kinds) == {"missing text": 20, "empty text": 5, "text not a string": 2}
    assert [p.line for p in scan.invalid.first] == [1, 4, 7, 10]
    text = "\n".join(report.warnings())
    assert "skipped 27 invalid rows" in text and "20 missing text" in text and "... and 23 more" in text


# ---------------------------------------------------------------------------
# duplicates and leaks


def test_normalised_duplicates_are_reported_and_optionally_dropped(tmp_path):
    rows = [{"text": "Hello, World!"}, {"text": "今天天气很好。"}, {"text": "hello world"},
            {"text": "ＨＥＬＬＯ　ＷＯＲＬＤ"}, {"text": "今天 天气 很好"}, {"text": "今天天气很好吗"}]
    assert normalise_for_dedup("ＨＥＬＬＯ　ＷＯＲＬＤ！") == "helloworld"
    report, out = run_prepare(tmp_path, rows)
    dups = report.scans["train"].duplicates
    assert dups.count == 3
    assert [(p.line, p.reason) for p in dups.first] == [
        (3, "same text as line 1"), (4, "same text as line 1"), (5, "same text as line 2")]
    assert pq.read_table(out / "train.parquet").num_rows == 6  # kept by default
    assert "duplicates: 3 rows" in "\n".join(report.warnings())

    report, out = run_prepare(tmp_path, rows, drop_duplicates=True)
    kept = pq.read_table(out / "train.parquet").column("extra_info").to_pylist()
    assert [r["text"] for r in kept] == ["Hello, World!", "今天天气很好。", "今天天气很好吗"]
    assert [r["index"] for r in kept] == [0, 1, 2]


def test_test_texts_found_in_train_are_a_leak_refused_unless_allowed(tmp_path):
    """A leak was only warned about (exit 0); now an error naming the line, and
    nothing written, unless --allow-leak keeps it (and the warning says so)."""
    train = [{"text": "今天天气很好。"}, {"text": "请把窗户关上。"}]
    test = [{"text": "新的句子。"}, {"text": "请把窗户关上"}]
    with pytest.raises(DataError, match=r"train/test leak: 1 of the test texts(.|\n)*test.jsonl:2: same text as "
                                        r"train line 2(.|\n)*--allow-leak"):
        run_prepare(tmp_path, train, test)
    assert not (tmp_path / "out").exists()
    report, _ = run_prepare(tmp_path, train, test, allow_leak=True)
    leaks = report.scans["test"].leaks
    assert leaks.count == 1 and (leaks.first[0].line, leaks.first[0].reason) == (2, "same text as train line 2")
    assert "train/test leak: 1 of the test texts" in "\n".join(report.warnings())


# ---------------------------------------------------------------------------
# size and atomicity


@pytest.mark.slow  # a large input: ~7 s
def test_huge_input_is_streamed_in_chunks(tmp_path):
    n, chunk = 200_000, 10_000
    train = tmp_path / "train.jsonl"
    with open(train, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(f'{{"id": "u{i}", "text": "第{i}句话，今天天气很好。"}}\n')
    chunks = []
    report, out = run_prepare(tmp_path, train, chunk_size=chunk,
                              on_chunk=lambda split, rows: chunks.append((split, rows)))
    assert report.scans["train"].rows == n
    # the writer got chunk_size rows at a time: one row group per chunk
    assert [rows for split, rows in chunks if split == "train"] == [chunk] * (n // chunk)
    meta = pq.ParquetFile(out / "train.parquet").metadata
    assert meta.num_rows == n and meta.num_row_groups == math.ceil(n / chunk)
    assert all(meta.row_group(i).num_rows == chunk for i in range(meta.num_row_groups))
    last = pq.ParquetFile(out / "train.parquet").read_row_group(meta.num_row_groups - 1).to_pylist()[-1]
    assert last["id"] == f"u{n - 1}" and last["extra_info"]["index"] == n - 1
    assert last["prompt"][0]["content"] == f"第{n - 1}句话，今天天气很好。"


@pytest.mark.parametrize("fail_in", ["train", "test"])
def test_failure_while_writing_leaves_previous_files_and_no_partial_file(tmp_path, fail_in):
    rows = [{"text": f"第{i}句。"} for i in range(50)]
    _, out = run_prepare(tmp_path, rows, rows[:20], chunk_size=10, allow_leak=True)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["test.parquet", "train.parquet"]

    class Crash(Exception):
        pass

    def crash(split, rows_written):
        if split == fail_in:
            raise Crash()

    new_rows = [{"text": f"新的第{i}句。"} for i in range(50)]
    with pytest.raises(Crash):
        run_prepare(tmp_path, new_rows, new_rows[:20], chunk_size=10, on_chunk=crash, allow_leak=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no temp file left either

    fresh = tmp_path / "fresh"
    with pytest.raises(Crash):
        run_prepare(tmp_path, new_rows, new_rows[:20], chunk_size=10, on_chunk=crash, local_dir=fresh,
                    allow_leak=True)
    assert list(fresh.iterdir()) == []


def test_output_files_get_normal_permissions(tmp_path):
    _, out = run_prepare(tmp_path, [{"text": "好"}])
    mask = os.umask(0)
    os.umask(mask)
    assert (out / "train.parquet").stat().st_mode & 0o777 == 0o666 & ~mask


# ---------------------------------------------------------------------------
# the project's own corpus and bad-line fixture (both committed: a missing one fails here)


def test_bad_lines_fixture(tmp_path):
    with pytest.raises(DataError) as err:
        run_prepare(tmp_path, BAD_FIXTURE)
    message = str(err.value)
    for line in (2, 3, 4, 6, 7, 9, 11, 12, 13):
        assert f"{BAD_FIXTURE}:{line}: " in message
    for line in (1, 5, 8, 10, 14):
        assert f"{BAD_FIXTURE}:{line}: " not in message
    report, out = run_prepare(tmp_path, BAD_FIXTURE, skip_invalid=True)
    scan = report.scans["train"]
    assert scan.invalid.count == 9 and scan.rows == 5
    assert [(p.line, p.reason) for p in scan.duplicates.first] == [(8, "same text as line 1")]
    ids = pq.read_table(out / "train.parquet").column("id").to_pylist()
    assert ids == ["line_01", "line_05", "line_08", "line_10", "line_14"]


def test_project_corpus_prepares_cleanly(tmp_path, tok_dir):
    report, out = run_prepare(tmp_path, CORPUS / "train.jsonl", CORPUS / "test.jsonl", tokenizer=tok_dir)
    for split in ("train", "test"):
        lines = [line for line in (CORPUS / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
                 if line.strip()]
        scan = report.scans[split]
        assert scan.invalid.count == 0 and scan.duplicates.count == 0
        assert pq.read_table(out / f"{split}.parquet").num_rows == len(lines)
    assert report.scans["test"].leaks.count == 0  # held-out means held out


# ---------------------------------------------------------------------------
# the command line


def test_cli_help_explains_options():
    res = run_cli("--help")
    assert res.returncode == 0
    for opt in ("--train_file", "--test_file", "--local_dir", "--tokenizer", "--max_prompt_length",
                "--skip-invalid", "--drop-duplicates", "--data-source", "--chunk-size", "--quiet",
                "reward_model", "extra_info", "upper bound", "temporary files"):
        assert opt in res.stdout, opt


@pytest.mark.slow  # CLI round trips: ~6 s
def test_cli_reports_errors_and_skips(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"text": "第一句。"}\n{"text": 1}\n{"text": "第一句"}\n', encoding="utf-8")
    test = write_jsonl(tmp_path / "test.jsonl", [{"text": "测试。"}])
    args = ["--train_file", str(train), "--test_file", str(test), "--local_dir", str(tmp_path / "out")]
    res = run_cli(*args)
    assert res.returncode == 2
    assert f"error: 1 invalid rows in {train}" in res.stderr and f"{train}:2: field" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "out").exists()

    res = run_cli(*args, "--skip-invalid", "--data-source", "mine")
    assert res.returncode == 0, res.stderr
    assert "skipped 1 invalid rows" in res.stderr and f"{train}:3: same text as line 1" in res.stderr
    assert "train: 2 rows" in res.stdout
    assert set(pq.read_table(tmp_path / "out" / "train.parquet").column("data_source").to_pylist()) == {"mine"}


# ---------------------------------------------------------------------------
# hostile input: clear errors with FILE:LINE, exit 2, no traceback

DEEP = "[" * 100_000 + "]" * 100_000
HOSTILE_ROWS = {
    "lone surrogate": ('{"text": "a\\ud800b"}', "lone UTF-16 surrogate"),
    "huge integer": ('{"text": "好", "n": ' + "9" * 5000 + "}", "a number Python cannot read"),
    "deep nesting": ('{"text": "好", "x": ' + DEEP + "}", "nested too deeply"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_ROWS))
def test_hostile_jsonl_row_is_a_row_error_with_file_and_line(tmp_path, kind):
    line, message = HOSTILE_ROWS[kind]
    train = tmp_path / "train.jsonl"
    train.write_text('{"text": "你好"}\n' + line + '\n{"text": "再见"}\n', encoding="utf-8")
    test = write_jsonl(tmp_path / "test.jsonl", [{"text": "测试"}])
    out = tmp_path / "out"
    res = run_main("prepare_data", "--train_file", str(train), "--test_file", str(test), "--local_dir", str(out), "-q")
    assert res.returncode == 2, res.stderr
    assert f"{train}:2: " in res.stderr and message in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not out.exists()
    res = run_main("prepare_data", "--train_file", str(train), "--test_file", str(test), "--local_dir", str(out), "-q",
                   "--skip-invalid")
    assert res.returncode == 0, res.stderr
    assert f"{train}:2: " in res.stderr and "Traceback" not in res.stderr
    texts = [r["text"] for r in pq.read_table(out / "train.parquet").column("extra_info").to_pylist()]
    assert texts == ["你好", "再见"]


@pytest.mark.parametrize("kind", sorted(HOSTILE_ROWS))
def test_hostile_json_array_element_is_fatal_with_file_and_line(tmp_path, kind):
    line, message = HOSTILE_ROWS[kind]
    train = tmp_path / "train.json"
    train.write_text('[\n{"text": "你好"},\n' + line + '\n]\n', encoding="utf-8")
    test = write_jsonl(tmp_path / "test.jsonl", [{"text": "测试"}])
    for extra in ((), ("--skip-invalid",)):
        res = run_main("prepare_data", "--train_file", str(train), "--test_file", str(test), "--local_dir",
                       str(tmp_path / "out"), "-q", *extra)
        if kind == "lone surrogate" and extra:  # parsed fine: a row problem, skippable
            assert res.returncode == 0, res.stderr
            assert f"{train}:3: " in res.stderr and message in res.stderr
            continue
        assert res.returncode == 2, res.stderr
        assert f"{train}:3: " in res.stderr and message in res.stderr, res.stderr
        assert "Traceback" not in res.stderr


def test_directory_as_input_says_so(tmp_path):
    test = write_jsonl(tmp_path / "test.jsonl", [{"text": "测试"}])
    res = run_cli("--train_file", str(tmp_path), "--test_file", str(test), "--local_dir", str(tmp_path / "o"))
    assert res.returncode == 2
    assert f"{tmp_path}: is a directory" in res.stderr and "no such file" not in res.stderr


def _unwritable_dirs(tmp_path: Path) -> list[tuple[Path, str]]:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [(a_file, "exists and is not a directory"),
             (a_file / "sub", f"{a_file} is not a directory"),
             (Path("/proc/ttsrl-out"), "cannot write in /proc")]  # unwritable even for root
    if os.geteuid() != 0:  # root ignores modes
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        cases.append((locked / "out", "cannot write in"))
    return cases


def test_unwritable_local_dir_is_a_clear_error_before_reading(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": "你好"}])
    test = write_jsonl(tmp_path / "test.jsonl", [{"text": "测试"}])
    for out, message in _unwritable_dirs(tmp_path):
        res = run_cli("--train_file", str(train), "--test_file", str(test), "--local_dir", str(out), "-q")
        assert res.returncode == 2, (out, res.stderr)
        assert f"--local_dir {out}: " in res.stderr and message in res.stderr, res.stderr
        assert "Traceback" not in res.stderr


def test_read_only_filesystem_local_dir(tmp_path):
    """A real read-only mount (a tmpfs mounted ro; needs root, else skipped)."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "none", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only filesystem here (needs root)")
    try:
        train = write_jsonl(tmp_path / "train.jsonl", [{"text": "你好"}])
        res = run_cli("--train_file", str(train), "--test_file", str(train), "--local_dir", str(mnt / "out"), "-q")
        assert res.returncode == 2, res.stderr
        assert f"--local_dir {mnt / 'out'}: cannot write in {mnt} (Read-only file system)" in res.stderr
        assert "Traceback" not in res.stderr
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_temp_parquet_of_a_killed_run_is_removed_by_the_next_run(tmp_path):
    """A writer killed with SIGKILL mid-write leaves its temp file; the next run deletes it."""
    import signal

    out = tmp_path / "out"
    out.mkdir()
    code = ("import sys, time; from ttsrl.atomic import atomic_path\n"
            f"with atomic_path({str(out / 'train.parquet')!r}) as tmp:\n"
            "    tmp.write_bytes(b'PAR1 partial'); print(tmp, flush=True); time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    leftover = Path(proc.stdout.readline().strip())
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert leftover.is_file() and leftover.parent == out
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": "你好"}])
    res = run_cli("--train_file", str(train), "--test_file", str(train), "--local_dir", str(out), "-q", "--allow-leak")
    assert res.returncode == 0, res.stderr
    assert not leftover.exists()
    assert sorted(p.name for p in out.iterdir()) == ["test.parquet", "train.parquet"]
