"""Zero-shot training rows: prompt pools, stage 0's prompt assignment and the
verl prompt it writes.

Real pieces throughout: pool files and Parquet on disk, verl 0.9.1's RLHFDataset and the
prompt builder its agent loop tokenises with, tiny tokenizers of Qwen's kind, and (where the
installed CosyVoice package is present) CosyVoice's own tokenizer class and ``Qwen2LM``. The only
fakes are the random-weight tiny models (CosyVoice2 weights cannot be had here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ttsrl.data.prepare import DataError, PrepareConfig, prepare
from ttsrl.data.prompt_pool import POOL_FILE, PoolError, first_choice, pool_sha1, read_pool
from ttsrl.data.rowchecks import normalise_for_dedup
from ttsrl.model import vocab as V

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

TRANSCRIPTS = ["今天天气很好。", "我们在2024年3月5日见面。", "重庆的银行行长来了。", "请把窗户关上。",
               "Hello world, 你好世界！", "一共是三百二十五块钱。", "我用iPhone拍照。", "他说我明天去北京。"]
TEXTS = TRANSCRIPTS + ["银行的行长在行走。", "你好，一个不是很长的句子。", "重庆的重量很重要，还要还钱。",
                       "二零二四年三月五日，百分之五十。"]


def write_pool(d: Path, n: int = 8, speech_len=lambda i: 5 + 3 * i, extra: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"spk{i % 3}_{i:02d}", "prompt_text": TRANSCRIPTS[i % len(TRANSCRIPTS)],
             "prompt_speech_tokens": [(37 * i + 11 * k) % V.family("cosyvoice2").speech_token_size for k in range(speech_len(i))],
             **(extra or {})} for i in range(n)]
    (d / POOL_FILE).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return d


def run(tmp: Path, texts=TEXTS, test=("测试集的句子。",), **kw):
    tmp.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", texts), ("test.jsonl", test)):
        (tmp / name).write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in rows),
                                encoding="utf-8")
    cfg = PrepareConfig(train_file=tmp / "train.jsonl", test_file=tmp / "test.jsonl", local_dir=tmp / "out",
                        progress=False, **kw)
    report = prepare(cfg)
    return report, {s: pq.read_table(tmp / "out" / f"{s}.parquet").to_pylist() for s in ("train", "test")}


# ---------------------------------------------------------------------------
# the pool file


def test_pool_read_sorted_by_id_and_its_sha1_is_the_servers(tmp_path):
    from ttsrl.reward.backends.base import prompt_pool_sha1

    pool = read_pool(write_pool(tmp_path / "pool", 5, extra={"speaker": "spk"}))
    ids = [p.id for p in pool.prompts]
    assert ids == sorted(ids) and len(pool) == 5 and pool.prompts[0].speaker == "spk"
    assert pool.sha1 == prompt_pool_sha1(ids) == pool_sha1(reversed(ids))
    assert pool.sha1 != pool_sha1(ids[:-1])


def test_pool_problems_are_listed_with_file_and_line(tmp_path):
    d = tmp_path / "pool"
    d.mkdir()
    lines = [
        {"id": "a", "prompt_text": "你好。", "prompt_speech_tokens": [1, 2]},                   # 1 ok
        {"id": "a", "prompt_text": "再见。", "prompt_speech_tokens": [3]},                      # 2 duplicate
        {"id": "b", "prompt_text": "好。", "prompt_speech_tokens": [V.family("cosyvoice2").speech_token_size]},      # 3 out of range
        {"id": "c", "prompt_text": "好。", "prompt_speech_tokens": [1, True]},                  # 4 not an integer
        {"id": "d", "prompt_text": "  ", "prompt_speech_tokens": [1]},                          # 5 empty transcript
        {"id": "e", "prompt_text": "好。", "prompt_speech_tokens": []},                         # 6 no tokens
        {"id": "f/g", "prompt_text": "好。", "prompt_speech_tokens": [1]},                      # 7 not a stem
        {"id": "h", "prompt_speech_tokens": [1]},                                               # 8 no transcript
        {"id": "i", "prompt_text": "好<|s_3|>", "prompt_speech_tokens": [1]},                   # 9 speech token name
    ]
    text = "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines) + "not json\n"  # 10
    (d / POOL_FILE).write_text(text, encoding="utf-8")
    with pytest.raises(PoolError) as e:
        read_pool(d)
    msg = str(e.value)
    f = d / POOL_FILE
    assert f"{f}:2: id 'a' already on line 1" in msg
    n = V.family("cosyvoice2").speech_token_size
    assert f"{f}:3: \"prompt_speech_tokens\" holds {n}, outside 0..{n - 1}" in msg
    assert f"{f}:4: \"prompt_speech_tokens\" holds True, not an integer" in msg
    assert f"{f}:5: \"prompt_text\" must be a non-empty string" in msg
    assert f"{f}:6: \"prompt_speech_tokens\" must be a non-empty list" in msg
    assert f"{f}:7: \"id\" 'f/g' is not usable as a file stem" in msg
    assert f"{f}:8: no \"prompt_text\"" in msg and "zero-shot training needs each wav's transcript" in msg
    assert f"{f}:9: \"prompt_text\" holds '<|s_3|>'" in msg
    assert f"{f}:10:" in msg and "9 problem(s)" in msg
    assert f"{f}:1:" not in msg


def test_pool_folder_file_and_wavs(tmp_path):
    with pytest.raises(PoolError, match="not a folder"):
        read_pool(tmp_path / "missing")
    with pytest.raises(PoolError, match=f"no {POOL_FILE}"):
        read_pool(tmp_path)
    (tmp_path / POOL_FILE).write_text("\n", encoding="utf-8")
    with pytest.raises(PoolError, match="no prompts"):
        read_pool(tmp_path)
    d = write_pool(tmp_path / "pool", 2)
    read_pool(d)  # no wavs needed by default (the embedded world's pool has none)
    (d / "spk0_00.wav").write_bytes(b"")
    with pytest.raises(PoolError, match=r"id 'spk1_01' has no wav .*spk1_01\.wav") as e:
        read_pool(d, need_wavs=True)
    assert "spk0_00" not in str(e.value)
    # transcripts may be absent where only the server reads the pool
    (d / POOL_FILE).write_text(json.dumps({"id": "x", "prompt_speech_tokens": [1]}) + "\n", encoding="utf-8")
    assert read_pool(d, need_text=False).prompts[0].prompt_text == ""


# ---------------------------------------------------------------------------
# assignment


def test_assignment_is_reproducible_seed_dependent_and_never_the_rows_own_text(tmp_path):
    pool_dir = write_pool(tmp_path / "pool")
    pool = read_pool(pool_dir)
    _, a = run(tmp_path / "a", prompt_pool=pool_dir, prompt_seed=3)
    _, b = run(tmp_path / "b", prompt_pool=pool_dir, prompt_seed=3)
    _, c = run(tmp_path / "c", prompt_pool=pool_dir, prompt_seed=4)
    ids = {k: [r["extra_info"]["prompt_id"] for r in rows["train"]] for k, rows in (("a", a), ("b", b), ("c", c))}
    assert ids["a"] == ids["b"] and ids["a"] != ids["c"]
    assert a == b  # the whole files
    by_id = {p.id: p for p in pool.prompts}
    for split, rows in a.items():
        for i, row in enumerate(rows):
            info = row["extra_info"]
            p = by_id[info["prompt_id"]]
            assert info["index"] == i and info["split"] == split and info["prompt_text"] == p.prompt_text
            assert normalise_for_dedup(p.prompt_text) != normalise_for_dedup(info["text"])
            # the documented rule: the first prompt along from sha256(seed:split:index) whose transcript is not
            # the row's text (no tokenizer here, so nothing else passes a prompt by)
            start = first_choice(3, split, i, len(pool))
            walk = [pool.prompts[(start + k) % len(pool)] for k in range(len(pool))]
            assert p == next(q for q in walk if normalise_for_dedup(q.prompt_text) != normalise_for_dedup(info["text"]))
            assert row["prompt"] == [{"role": "user", "content": p.prompt_text + info["text"]},
                                     {"role": "assistant", "content": V.SpeechVocab.codes_to_text(p.speech)}]
    # rows whose text is a transcript were walked on at least once (8 of the 12 texts are)
    assert sum(ids["a"][i] != pool.prompts[first_choice(3, "train", i, 8)].id for i in range(len(TEXTS))) >= 1


def test_one_prompt_pool_whose_transcript_is_the_text_leaves_the_row_invalid(tmp_path):
    pool_dir = write_pool(tmp_path / "pool", 1)
    with pytest.raises(DataError, match=r"train\.jsonl:1: no prompt of the pool fits this row \(passed by: its "
                                        r"transcript is the row's text 1"):
        run(tmp_path / "r", prompt_pool=pool_dir)
    report, rows = run(tmp_path / "s", prompt_pool=pool_dir, skip_invalid=True)
    assert len(rows["train"]) == len(TEXTS) - 1
    assert {r["extra_info"]["prompt_id"] for r in rows["train"]} == {"spk0_00"}


def test_a_bad_pool_stops_stage_0_before_anything_is_written(tmp_path):
    d = tmp_path / "pool"
    d.mkdir()
    (d / POOL_FILE).write_text('{"id": "a", "prompt_speech_tokens": [1]}\n', encoding="utf-8")
    with pytest.raises(PoolError, match="zero-shot training needs"):
        run(tmp_path / "r", prompt_pool=d)
    assert not (tmp_path / "r" / "out").exists()


# ---------------------------------------------------------------------------
# the verl prompt, its ids and its length


@pytest.fixture(scope="module")
def cv2_hf_tokenizer(tiny_hf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_hf))


def verl_ids(tokenizer, raw_prompt) -> list[int]:
    """What verl 0.9.1's single-turn agent loop hands the rollout: its Qwen continuous-token builder."""
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    return create_continuous_token_builder(tokenizer, hf_model_type="qwen2").build_initial_tokens(raw_prompt)


def load_rlhf(path: Path, tokenizer, budget: int, tmp: Path):
    import datasets
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    datasets.config.HF_DATASETS_CACHE = str(tmp / "hf_cache")
    config = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": budget, "filter_overlong_prompts": True,
                               "filter_overlong_prompts_workers": 1, "truncation": "error",
                               "cache_dir": str(tmp / "verl_cache")})
    return RLHFDataset(data_files=[str(path)], tokenizer=tokenizer, config=config)


def test_prompted_rows_render_through_verl_to_cosyvoice2s_zero_shot_input(tmp_path, tiny_cosyvoice2, tiny_hf,
                                                                          cv2_hf_tokenizer):
    """verl's RLHFDataset + agent-loop builder give, for every row, exactly stage 4's zero-shot ids
    (``build_input_ids``) and CosyVoice2's own: its tokenizer class on CosyVoice-BlankEN, the
    transcript and the text each tokenised on its own (``frontend_zero_shot``), and its ``Qwen2LM``
    computes the same logits over them as the converted model over verl's ids."""
    from ttsrl.model.generate import build_input_ids, make_requests

    tok = cv2_hf_tokenizer
    sv = V.vocab_of(tok)
    pool_dir = write_pool(tmp_path / "pool")
    report, rows = run(tmp_path / "r", prompt_pool=pool_dir, tokenizer=tiny_hf, max_prompt_length=200)
    assert report.pool_checked and "counted exactly" in report.length_description
    ds = load_rlhf(tmp_path / "r" / "out" / "train.parquet", tok, 200, tmp_path)
    assert len(ds) == len(TEXTS)
    pool = {p.id: p for p in read_pool(pool_dir).prompts}
    got = []
    for i in range(len(ds)):
        item = ds[i]
        info = item["extra_info"]
        p = pool[info["prompt_id"]]
        ids = verl_ids(tok, item["raw_prompt"])
        (req,) = make_requests(tok, [_Utt(p.id, info["text"], p.prompt_text, p.speech)])
        assert ids == build_input_ids(sv, req)
        enc = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
        assert ids == [sv.sos_id] + enc(p.prompt_text) + enc(info["text"]) + [sv.task_id] + sv.codes_to_ids(p.speech)
        assert ids[-len(p.speech):] == sv.codes_to_ids(p.speech)  # nothing after the prompt speech: the rollout
        assert len(ids) <= report.scans["train"].max_prompt_tokens  # continues it, the response is the rest
        got.append((ids, p, info["text"]))
    assert max(len(g[0]) for g in got) == report.scans["train"].max_prompt_tokens

    try:
        from cosyvoice.tokenizer.tokenizer import QwenTokenizer
    except ImportError as e:
        pytest.skip(f"CosyVoice's code is not installed ({e}; requirements-cosyvoice-cpu.txt)")
    import torch

    from ttsrl.model.convert import cosyvoice_own_lm, cosyvoice_own_logits, inner_config_of, load_llm_state_dict
    from ttsrl.model.hf_model import load_speech_lm

    up = QwenTokenizer(str(tiny_cosyvoice2[0] / "CosyVoice-BlankEN"))  # what CosyVoice2's frontend encodes with
    lm = cosyvoice_own_lm(inner_config_of(json.loads((tiny_hf / "config.json").read_text())), V.family("cosyvoice2"))
    lm.load_state_dict(load_llm_state_dict(tiny_cosyvoice2[0] / "llm.pt"), strict=True)
    hf = load_speech_lm(tiny_hf, dtype=torch.float32)
    lo, hi = sv.output_range
    for ids, p, text in got[:4]:
        text_ids = up.encode(p.prompt_text) + up.encode(text)  # Qwen2LM.inference: concat([prompt_text, text])
        assert ids == [sv.sos_id] + text_ids + [sv.task_id] + sv.codes_to_ids(p.speech)
        with torch.no_grad():
            theirs = cosyvoice_own_logits(lm.eval(), text_ids, p.speech)
            ours = hf.model(torch.tensor([ids])).logits[0, :, lo:hi]
        assert (theirs - ours).abs().max().item() < 1e-4


class _Utt:
    def __init__(self, id, text, prompt_text, prompt_speech):
        self.id, self.text, self.prompt_text, self.prompt_speech = id, text, prompt_text, prompt_speech


def test_cosyvoice3_rows_carry_its_system_prefix(tmp_path):
    """CosyVoice3's zero-shot input: upstream's tokenizer (CosyVoice3Tokenizer's specials on the same base)
    on "You are a helpful assistant.<|endofprompt|>" + transcript, then the text on its own."""
    from cosyvoice3_tiny import upstream_tokenizer
    from transformers import AutoTokenizer

    from ttsrl.embedded.tiny_tokenizer import save_blank_en, train_tokenizer

    base = train_tokenizer(TEXTS * 3, vocab_size=400)
    save_blank_en(base, tmp_path / "blank")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "blank"))
    sv = V.extend_tokenizer(tok, V.family("cosyvoice3"))
    save_blank_en(tok, tmp_path / "hf")
    up = upstream_tokenizer(tmp_path / "blank")
    pool_dir = write_pool(tmp_path / "pool", 4)
    _, rows = run(tmp_path / "r", prompt_pool=pool_dir, tokenizer=tmp_path / "hf", max_prompt_length=300)
    pool = {p.id: p for p in read_pool(pool_dir).prompts}
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    for row in rows["train"] + rows["test"]:
        p, text = pool[row["extra_info"]["prompt_id"]], row["extra_info"]["text"]
        head = up(V.family("cosyvoice3").system_prefix + p.prompt_text)["input_ids"]
        assert verl_ids(tok, row["prompt"]) == ([sv.sos_id] + head + up(text)["input_ids"] + [sv.task_id]
                                                + sv.codes_to_ids(p.speech))


def test_length_budget_counts_the_prompt_speech(tmp_path, tiny_hf, cv2_hf_tokenizer):
    """The exact count is the row's full zero-shot input; one token less and the row is refused (a
    one-prompt pool leaves no other prompt to walk to); the estimate without a tokenizer is never lower."""
    tok = cv2_hf_tokenizer
    pool_dir = write_pool(tmp_path / "pool", 1, speech_len=lambda i: 40)
    texts = TEXTS[1:]
    report, rows = run(tmp_path / "a", texts=texts, prompt_pool=pool_dir, tokenizer=tiny_hf, max_prompt_length=500)
    exact = [len(verl_ids(tok, r["prompt"])) for r in rows["train"]]
    p = read_pool(pool_dir).prompts[0]
    enc = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    assert exact == [2 + len(enc(p.prompt_text)) + len(enc(t)) + 40 for t in texts]
    budget = max(exact)
    assert report.scans["train"].max_prompt_tokens == budget
    run(tmp_path / "b", texts=texts, prompt_pool=pool_dir, tokenizer=tiny_hf, max_prompt_length=budget)
    longest = exact.index(budget) + 1
    with pytest.raises(DataError, match=rf"train\.jsonl:{longest}: no prompt of the pool fits this row \(passed by: "
                                        r"over --max_prompt_length with it 1"):
        run(tmp_path / "c", texts=texts, prompt_pool=pool_dir, tokenizer=tiny_hf, max_prompt_length=budget - 1)
    est, _ = run(tmp_path / "d", texts=texts, prompt_pool=pool_dir, max_prompt_length=5000)
    assert est.scans["train"].max_prompt_tokens >= budget
    assert est.scans["train"].sum_prompt_tokens >= sum(exact)


def test_text_only_rows_without_a_pool_are_as_before(tmp_path):
    _, rows = run(tmp_path / "a")
    assert rows["train"][0]["prompt"] == [{"role": "user", "content": TEXTS[0]}]
    assert rows["train"][0]["extra_info"] == {"split": "train", "index": 0, "text": TEXTS[0]}


def test_a_prompt_whose_transcript_merges_with_the_text_is_passed_by(tmp_path):
    """A byte-level BPE can merge the transcript's last character with the text's first when verl
    tokenises the rendered prompt in one piece; CosyVoice tokenises them apart. Stage 0 then walks on to
    a prompt that tokenises apart (and says so), so every row's ids stay CosyVoice's."""
    from transformers import AutoTokenizer

    from ttsrl.embedded.tiny_tokenizer import save_blank_en, train_tokenizer

    text = "今天下雨。"
    base = train_tokenizer(["好。今天下雨。"] * 60 + TEXTS * 3, vocab_size=400)  # learns a "。今" merge
    V.extend_tokenizer(base, "cosyvoice2")
    save_blank_en(base, tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    enc = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    assert enc("很好。" + text) != enc("很好。") + enc(text)  # the premise: a merge across the boundary
    assert enc("很好吗" + text) == enc("很好吗") + enc(text)
    d = tmp_path / "pool"
    d.mkdir()
    (d / POOL_FILE).write_text("".join(json.dumps({"id": i, "prompt_text": t, "prompt_speech_tokens": [5, 6]},
                                                  ensure_ascii=False) + "\n" for i, t in (("a", "很好。"), ("b", "很好吗"))),
                               encoding="utf-8")
    seeds = [s for s in range(20) if first_choice(s, "train", 0, 2) == 0][:1]  # a seed whose walk starts at "a"
    report, rows = run(tmp_path / "r", texts=[text], prompt_pool=d, prompt_seed=seeds[0], tokenizer=tmp_path / "hf")
    assert rows["train"][0]["extra_info"]["prompt_id"] == "b"
    assert "1 times a row passed a pool prompt by because the template's tokenisation merges" in "\n".join(
        report.warnings())
    sv = V.vocab_of(tok)
    assert verl_ids(tok, rows["train"][0]["prompt"]) == ([sv.sos_id] + enc("很好吗") + enc(text) + [sv.task_id]
                                                         + sv.codes_to_ids([5, 6]))


# ---------------------------------------------------------------------------
# run.sh's PROMPT_POOL and the up-front input check


def test_prompt_pool_setting_reaches_stage_0_and_the_reward_server(tmp_path):
    """PROMPT_POOL (bash run.sh --config shows it) becomes the reward server's --prompt-dir; a preset's
    other --prompt-dir is refused; a run from stage 0 needs the folder and its jsonl; gpu8's PROMPT_DIR
    follows the pool, so a user writes the path once."""
    from test_run_sh_settings import _config

    from ttsrl.launch import settings

    pool = write_pool(tmp_path / "pool", 2)
    got = _config({"PROMPT_POOL": str(pool), "PROMPT_SEED": "7"})
    assert got["PROMPT_POOL"] == str(pool) and got["PROMPT_SEED"] == "7"
    assert got["REWARD_ARGS"][-2:] == ["--prompt-dir", str(pool)]
    plain = _config(preset="presets/gpu8.sh")  # no pool by default: text-only rows, the reference's speakers
    assert plain["PROMPT_POOL"] == "" and plain["CHECK_INPUTS_ARGS"][-2:] != ["--prompt-pool", ""]
    assert plain["REWARD_ARGS"][plain["REWARD_ARGS"].index("--prompt-dir") + 1] == "data/speaker_prompts"
    gpu = _config({"PROMPT_POOL": str(pool)}, preset="presets/gpu8.sh")
    assert gpu["REWARD_ARGS"].count("--prompt-dir") == 1
    assert gpu["REWARD_ARGS"][gpu["REWARD_ARGS"].index("--prompt-dir") + 1] == str(pool)
    assert gpu["CHECK_INPUTS_ARGS"][-2:] == ["--prompt-pool", str(pool)]
    gpu = _config({"PROMPT_POOL": str(pool), "PROMPT_DIR": str(tmp_path)}, preset="presets/gpu8.sh")
    assert gpu["REWARD_ARGS"][gpu["REWARD_ARGS"].index("--prompt-dir") + 1] == str(pool)  # the pool wins
    r = _config({"PROMPT_POOL": str(pool), "REWARD_EXTRA": f"--prompt-dir {tmp_path}"}, ok=False)
    assert r.returncode != 0 and f"PROMPT_POOL={pool} but REWARD_ARGS voice from --prompt-dir {tmp_path}" in r.stderr

    env = {"DEVICE": "cpu", "EXP_DIR": "exp/e", "COSYVOICE2_DIR": "b", "TRAIN_FILE": "t.jsonl", "TEST_FILE": "s.jsonl",
           "MAX_PROMPT_LENGTH": "32", "REWARD_BACKEND": "sim", "EVAL_NPROC": "1"}
    arrays = {"REWARD_ARGS": [], "GRPO_ARGS": [], "EVAL_ARGS": []}
    with pytest.raises(settings.SettingsError, match="no such folder"):
        settings.resolve({**env, "PROMPT_POOL": str(tmp_path / "none")}, arrays, ["0", "2"])
    with pytest.raises(settings.SettingsError, match="no prompt_speech_tokens.jsonl in it"):
        settings.resolve({**env, "PROMPT_POOL": str(tmp_path)}, arrays, ["1", "5"])
    settings.resolve({**env, "PROMPT_POOL": str(tmp_path / "none")}, arrays, ["-1", "5"])  # stage -1 may build it
    with pytest.raises(settings.SettingsError, match="PROMPT_SEED=x"):
        settings.resolve({**env, "PROMPT_SEED": "x"}, arrays, ["0", "0"])


def test_check_inputs_checks_the_pool_and_its_wavs(tmp_path):
    import numpy as np
    import soundfile as sf

    pool = write_pool(tmp_path / "pool", 2)
    cmd = [sys.executable, str(ROOT / "scripts" / "check_inputs.py"), "--prompt-pool", str(pool)]
    import subprocess

    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "prompt pool (PROMPT_POOL)" in r.stderr and "has no wav" in r.stderr
    sf.write(pool / "spk0_00.wav", np.zeros(16000, dtype=np.float32), 16000)
    sf.write(pool / "spk1_01.wav", np.zeros(8000, dtype=np.float32), 8000)  # under 16 kHz
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "prompt pool wav" in r.stderr and "spk1_01.wav" in r.stderr
    assert "spk0_00.wav" not in r.stderr
    sf.write(pool / "spk1_01.wav", np.zeros(16000, dtype=np.float32), 16000)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_prompt_tokens_reads_transcripts_from_meta_lst_cv3_and_texts(tmp_path):
    """scripts/prompt_tokens.py's inputs carry the transcripts a pool needs (the speech tokenizer itself
    needs CosyVoice2's ONNX model, which cannot be had here)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import prompt_tokens

    (tmp_path / "meta.lst").write_text("u1|希望你以后能够做的比我还好呦。|wavs/u1.wav|收到好友的礼物。\n", encoding="utf-8")
    items, base, texts = prompt_tokens.read_wav_list(tmp_path)
    assert items == [("u1", tmp_path / "wavs" / "u1.wav")] and texts == {"u1": "希望你以后能够做的比我还好呦。"}
    cv3 = tmp_path / "cv3"
    cv3.mkdir()
    (cv3 / "prompt_wav.scp").write_text("a x/a.wav\nb x/b.wav\n", encoding="utf-8")
    (cv3 / "prompt_text").write_text("a 今天 天气\n", encoding="utf-8")
    assert prompt_tokens.read_wav_list(cv3)[2] == {"a": "今天 天气"}
    (tmp_path / "texts").write_text("a 你好\n\nb\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"texts:3: expected 'ID transcript'"):
        prompt_tokens.read_texts(tmp_path / "texts")


BAD_IDS = ("a\tb", "a\u200bb", "a\x85b")  # a tab, a zero-width space, NEL: each refused (400) by the server


def test_one_prompt_id_rule_for_stage_0_the_server_and_the_checker(tmp_path):
    """Ids the server refuses on the wire (a control or format character) were accepted by stage 0,
    the server's --prompt-dir and check_inputs.py: every request naming one then got 400, its
    reward 0 or its group dropped. One rule now (ttsrl.data.prompt_pool.prompt_id_problem): stage 0
    and the checker list each such line, the server does not start on such a pool, the wire uses
    the same function."""
    import subprocess
    import types

    import numpy as np
    import soundfile as sf

    from ttsrl.data import prompt_pool
    from ttsrl.reward import infer_request
    from ttsrl.reward.server import RewardServer

    assert infer_request.prompt_id_problem is prompt_pool.prompt_id_problem
    pool = write_pool(tmp_path / "pool", 3)
    rows = [json.loads(line) for line in (pool / POOL_FILE).read_text().splitlines()]
    for row, bad in zip(rows, BAD_IDS):
        row["id"] = bad
    (pool / POOL_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(PoolError) as e:  # stage 0 and the sim server read the pool through read_pool
        read_pool(pool)
    for line, bad in enumerate(BAD_IDS, 1):
        assert f"{POOL_FILE}:{line}: \"id\" {bad!r} is not usable as a file stem: it holds the character" \
            in str(e.value), str(e.value)
    # check_inputs.py: the pool, and a prompt folder whose wav stems are the ids a cosyvoice server serves
    wavs = tmp_path / "wavs"
    wavs.mkdir()
    for stem in ("ok", *BAD_IDS):
        sf.write(wavs / f"{stem}.wav", np.zeros(16000, dtype=np.float32), 16000)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_inputs.py"), "--prompt-pool", str(pool),
                        "--prompt-dir", str(wavs)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "prompt pool (PROMPT_POOL)" in r.stderr, r.stderr
    assert sum("the reward server would refuse it" in line for line in r.stderr.splitlines()) == 3, r.stderr
    # the server with such a folder (a cosyvoice backend: ids are the wav stems) refuses to start
    pipe = types.SimpleNamespace(name="r0", token2wav=types.SimpleNamespace(prompt_pool={s: None for s in
                                                                                      ("ok", *BAD_IDS)}))
    fake = types.SimpleNamespace(pipelines=[pipe], cfg=types.SimpleNamespace(
        backend=types.SimpleNamespace(prompt_dir=str(wavs))), prompt_ids=sorted(("ok", *BAD_IDS)))
    with pytest.raises(ValueError, match=r"3 prompt id\(s\) break the id rule"):
        RewardServer._check_prompt_pool(fake)


# ---------------------------------------------------------------------------
# a user's dev set (DEV_FILE) against the run: its mode, its pool prompts, the training texts


def _dev_row(pool, pid: str, text: str, like: str | None = None) -> dict:
    """A zero-shot dev row naming ``pid`` and carrying the transcript and tokens of ``like`` (default: its own)."""
    p = {q.id: q for q in pool.prompts}[like or pid]
    return {"text": text, "prompt_id": pid, "prompt_text": p.prompt_text, "prompt_speech_tokens": list(p.speech)}


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def test_dev_rows_are_checked_against_the_pool_prompt_they_name(tmp_path):
    """A dev row naming spk0_00 but carrying spk1_01's transcript and tokens was scored (prompted with one
    speaker, voiced by another: dev SIM at chance); now stage 0 names its FILE:LINE and what differs, and an
    id the pool does not know (a traceback in stage 4 before) is named here too."""
    pool_dir = write_pool(tmp_path / "pool", 4)
    pool = read_pool(pool_dir)
    good = [_dev_row(pool, "spk0_00", "开发集的第一句。"), _dev_row(pool, "spk1_01", "开发集的第二句。")]
    dev = _write_jsonl(tmp_path / "dev.jsonl", good)
    report, _ = run(tmp_path / "ok", prompt_pool=pool_dir, dev_file=dev)
    assert report.dev_leaks == []
    bad = _write_jsonl(tmp_path / "bad.jsonl", [good[0], _dev_row(pool, "spk0_00", "开发集的第三句。", like="spk1_01"),
                                                {**good[1], "prompt_id": "nobody"}])
    with pytest.raises(DataError) as e:
        run(tmp_path / "bad", prompt_pool=pool_dir, dev_file=bad)
    msg = str(e.value)
    assert f"{bad}: 2 of its 3 rows do not fit" in msg and f"{bad}:1:" not in msg
    assert f"{bad}:2: prompt_id 'spk0_00' ({pool.path}:1) but prompt_text" in msg and "prompt_speech_tokens" in msg
    assert f"{bad}:3: prompt_id 'nobody' is not in the pool {pool.path} (4 ids" in msg
    assert not (tmp_path / "bad" / "out" / "train.parquet").exists()


def test_a_dev_row_of_the_other_mode_is_named(tmp_path):
    """Text-only dev rows in a zero-shot run (stage 5 chose a zero-shot model on decoding without a prompt),
    and prompted dev rows in a text-only run, are named with the setting that decides the mode."""
    pool_dir = write_pool(tmp_path / "pool", 4)
    plain = _write_jsonl(tmp_path / "plain.jsonl", [{"text": "开发集的第一句。"}])
    with pytest.raises(DataError, match=rf"{plain}:1: a text-only dev row in a zero-shot run \(PROMPT_POOL={pool_dir}\)"):
        run(tmp_path / "a", prompt_pool=pool_dir, dev_file=plain)
    run(tmp_path / "b", dev_file=plain)  # text-only run, text-only rows: fine
    prompted = _write_jsonl(tmp_path / "prompted.jsonl", [_dev_row(read_pool(pool_dir), "spk0_00", "开发集的一句。")])
    with pytest.raises(DataError, match=rf"{prompted}:1: a prompted dev row \(prompt_id 'spk0_00'\) in a text-only run"):
        run(tmp_path / "c", dev_file=prompted)


def test_a_dev_text_that_is_a_training_text_is_refused_unless_allow_leak(tmp_path):
    """Stage 5 chose the step on dev texts the model trained on; such a dev set is now a leak, as a test set's is."""
    dev = _write_jsonl(tmp_path / "dev.jsonl", [{"text": "开发集的句子。"}, {"text": TEXTS[3]}, {"text": TEXTS[9]}])
    with pytest.raises(DataError) as e:
        run(tmp_path / "a", dev_file=dev)
    assert f"dev/train leak: 2 of the dev texts of {dev} also occur in" in str(e.value)
    assert f"{dev}:2: same text as train line 4" in str(e.value) and "--allow-leak" in str(e.value)
    report, _ = run(tmp_path / "b", dev_file=dev, allow_leak=True)
    assert any(w.startswith("dev/train leak: 2 of the dev texts") for w in report.warnings())


def test_an_empty_pool_names_the_pool_file_and_what_it_lacks(tmp_path):
    """An empty pool's error spoke of a "text" field (a text corpus's rows); now it names the pool file and
    the prompts it lacks."""
    d = tmp_path / "pool"
    d.mkdir()
    (d / POOL_FILE).write_text("\n\n", encoding="utf-8")
    with pytest.raises(PoolError) as e:
        read_pool(d)
    msg = str(e.value)
    assert msg.startswith(f"prompt pool {d}: no prompts: {d / POOL_FILE}: file is empty") and '"text"' not in msg
    assert '{"id": ..., "prompt_text": ..., "prompt_speech_tokens": [...]}' in msg and "prompt_tokens.py" in msg
