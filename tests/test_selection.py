"""Stage 5 chooses the step on the dev set, never on a test set (ttsrl.train.steps.choose_step,
huggingface_to_pretrained.py --from-sweep), and the default dev slice (ttsrl.data.devsplit)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ttsrl.data.devsplit import split_dev
from ttsrl.train.steps import choose_step

ROOT = Path(__file__).resolve().parents[1]

# dev and test disagree: the dev set's best step is 20, the test set's is 40
DEV = {0: 0.40, 20: 0.30, 40: 0.32}
TEST = {0: 0.41, 20: 0.33, 40: 0.25}


def sweep_rows(with_dev=True):
    rows = []
    for step in (0, 20, 40):
        sets = ([("dev", "dev", DEV)] if with_dev else []) + [("embedded_test", "test", TEST)]
        for name, role, val in sets:
            rows.append({"step": step, "test_set": name, "role": role, "headline": "cer_utt_mean",
                         "cer_utt_mean": val[step], "cer_pooled": 0.5, "cer": 0.5, "n": 10})
    return rows


def test_choice_uses_the_dev_set_only():
    c = choose_step(sweep_rows())
    assert c["step"] == 20 and c["chosen_on"] == ["dev"] and c["metric"] == "cer_utt_mean"
    assert c["value"] == pytest.approx(0.30)
    assert "dev set(s) dev" in c["reason"] and "never used to choose" in c["reason"]
    # by the other convention the pooled numbers tie everywhere: the earliest step
    assert choose_step(sweep_rows(), "cer_pooled")["step"] == 0


def test_no_dev_set_no_choice():
    # (stage 5's CLI refusing such a sweep is checked below, with the real command)
    c = choose_step(sweep_rows(with_dev=False))
    assert c["step"] is None and "No dev set" in c["reason"] and "EXPORT_STEP" in c["reason"]


@pytest.fixture
def merged_steps(tiny_hf, tmp_path):
    """merged/step_20 and step_40: copies of the tiny model, step 40's output bias shifted."""
    from safetensors.torch import load_file, save_file

    from ttsrl.model.checkpoint import write_marker

    merged = tmp_path / "merged"
    for step in (20, 40):
        d = merged / f"step_{step}"
        shutil.copytree(tiny_hf, d)
        if step == 40:
            f = d / "model.safetensors"
            sd = load_file(str(f))
            key = next(k for k in sd if k.endswith("lm_head.bias"))
            sd[key] = sd[key] + 1.0
            save_file(sd, str(f), metadata={"format": "pt"})
        write_marker(d, {"step": step})
    return merged


def export(tiny_hf, merged, summary, out, *extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(ROOT / "huggingface_to_pretrained.py"), "--from-sweep", str(summary),
                           "--merged-dir", str(merged), "--start-model", str(tiny_hf), "--output-path", str(out),
                           *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_stage5_exports_the_dev_choice_not_the_test_choice(tiny_hf, merged_steps, tmp_path):
    import torch

    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps(sweep_rows()))
    out = tmp_path / "llm-new.pt"
    p = export(tiny_hf, merged_steps, summary, out)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "exporting step 20" in p.stdout
    record = json.loads((tmp_path / "llm-new.pt.selection.json").read_text())
    assert record["step"] == 20 and record["chosen_by"] == "dev set"
    assert record["model"].endswith("step_20") and record["dev_choice"]["chosen_on"] == ["dev"]
    assert {r["test_set"] for r in record["rows_of_step"]} == {"dev", "embedded_test"}
    # the weights are step 20's (step 40's output bias differs by 1.0)
    bias = torch.load(out, map_location="cpu", weights_only=True)["llm_decoder.bias"]
    ref = tmp_path / "step40.pt"
    assert export(tiny_hf, merged_steps, summary, ref, "--step", "40").returncode == 0
    bias40 = torch.load(ref, map_location="cpu", weights_only=True)["llm_decoder.bias"]
    assert torch.allclose(bias40 - bias, torch.ones_like(bias))
    over = json.loads((tmp_path / "step40.pt.selection.json").read_text())
    assert over["step"] == 40 and over["chosen_by"] == "override" and "dev-set choice, step 20" in over["reason"]

    # a sweep without a dev set is refused (exit 2, says what to do), nothing written
    summary.write_text(json.dumps(sweep_rows(with_dev=False)))
    none = tmp_path / "none.pt"
    p = export(tiny_hf, merged_steps, summary, none)
    assert p.returncode == 2 and "No dev set" in p.stderr and not none.exists()


def test_dev_slice_is_fixed_held_out_and_keeps_copies_together(tmp_path):
    texts = [f"第{i}句话。" for i in range(30)] + ["重复的一句。", "重复的一句。"]
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    n_train, n_dev = split_dev(src, 8, tmp_path / "a")
    dev = [json.loads(x) for x in (tmp_path / "a" / "dev.jsonl").read_text().splitlines()]
    train = [json.loads(x) for x in (tmp_path / "a" / "train.jsonl").read_text().splitlines()]
    assert n_train + n_dev == len(texts) and n_dev in (8, 9) and len(dev) == n_dev
    assert not {d["text"] for d in dev} & {t["text"] for t in train}  # nothing held out is trained on
    assert len({d["id"] for d in dev}) == n_dev
    # the same slice whatever the line order
    src.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in reversed(texts)),
                   encoding="utf-8")
    split_dev(src, 8, tmp_path / "b")
    again = [json.loads(x)["text"] for x in (tmp_path / "b" / "dev.jsonl").read_text().splitlines()]
    assert sorted(again) == sorted(d["text"] for d in dev)
    with pytest.raises(ValueError, match="cannot hold out"):
        split_dev(src, 31, tmp_path / "c")
    src.write_text('{"text": "好"}\n{"txt": 1}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"train.jsonl:2: expected a non-empty string 'text'"):
        split_dev(src, 1, tmp_path / "d")


def test_zero_shot_dev_rows_get_pool_prompts_never_their_own_text(tmp_path):
    """With a prompt pool the dev rows are zero-shot, as the training rows are: each names one pool
    prompt (id, transcript, speech tokens), chosen by the seeded rule, never a prompt whose transcript
    is the row's own text; the split itself is the text-only one; stage 4 reads the rows as prompted."""
    from ttsrl.data.prompt_pool import first_choice, read_pool
    from ttsrl.data.testsets import read_jsonl_test_set

    texts = [f"第{i}句话。" for i in range(40)]
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    split_dev(src, 12, tmp_path / "plain")
    plain = [json.loads(x) for x in (tmp_path / "plain" / "dev.jsonl").read_text().splitlines()]
    own = plain[0]["text"]  # a dev text that is also a prompt's transcript: that prompt is walked past
    pool_dir = tmp_path / "pool"
    pool_dir.mkdir()
    prompts = [("p_a", own), ("p_b", "你好"), ("p_c", "再见")]
    (pool_dir / "prompt_speech_tokens.jsonl").write_text("".join(
        json.dumps({"id": i, "prompt_text": t, "prompt_speech_tokens": [k, k + 1]}, ensure_ascii=False) + "\n"
        for k, (i, t) in enumerate(prompts)), encoding="utf-8")
    seed = next(k for k in range(100) if first_choice(k, "dev", 0, 3) == 0)  # row 0 starts at its own text
    split_dev(src, 12, tmp_path / "zs", prompt_pool=pool_dir, prompt_seed=seed)
    dev = [json.loads(x) for x in (tmp_path / "zs" / "dev.jsonl").read_text().splitlines()]
    assert [d["text"] for d in dev] == [d["text"] for d in plain]  # the same slice
    assert (tmp_path / "zs" / "train.jsonl").read_text() == (tmp_path / "plain" / "train.jsonl").read_text()
    by_id = {p.id: p for p in read_pool(pool_dir).prompts}
    for i, row in enumerate(dev):
        p = by_id[row["prompt_id"]]
        assert row["prompt_text"] == p.prompt_text and row["prompt_speech_tokens"] == list(p.speech)
        assert row["prompt_text"] != row["text"]
        start = sorted(by_id)[first_choice(seed, "dev", i, len(by_id))]
        if by_id[start].prompt_text == row["text"]:  # its own text: the next prompt in id order
            assert row["prompt_id"] == sorted(by_id)[(sorted(by_id).index(start) + 1) % len(by_id)]
        else:
            assert row["prompt_id"] == start
    assert dev[0]["prompt_id"] == "p_b"
    assert len({d["prompt_id"] for d in dev}) > 1  # spread over the pool
    utts = read_jsonl_test_set("dev", tmp_path / "zs" / "dev.jsonl").utterances
    assert all(u.prompt_id and u.prompt_text and u.prompt_speech for u in utts)
    # another seed, another assignment; a pool that is only the row's own text: refused, naming it
    split_dev(src, 12, tmp_path / "zs8", prompt_pool=pool_dir, prompt_seed=seed + 1)
    assert (tmp_path / "zs8" / "dev.jsonl").read_text() != (tmp_path / "zs" / "dev.jsonl").read_text()
    (pool_dir / "prompt_speech_tokens.jsonl").write_text(
        json.dumps({"id": "p_a", "prompt_text": own, "prompt_speech_tokens": [1]}, ensure_ascii=False) + "\n",
        encoding="utf-8")
    with pytest.raises(ValueError, match=rf"row 1 \('{own}'\): every prompt of .* has this text"):
        split_dev(src, 12, tmp_path / "one", prompt_pool=pool_dir)


@pytest.mark.slow
def test_run_sh_holds_out_a_dev_set_and_stage5_chooses_on_it(tiny_cosyvoice2, tmp_path):
    """The embedded preset's stages 0, 4 and 5 on the tiny model: stage 0 holds DEV_SIZE
    training texts out of train.parquet, stage 4 scores them as the dev set next to the
    test set, stage 5 exports the dev set's choice and records why."""
    import pyarrow.parquet as pq
    from safetensors.torch import load_file, save_file

    from ttsrl.model.checkpoint import write_marker

    exp = tmp_path / "exp"
    preset = tmp_path / "preset.sh"
    preset.write_text((ROOT / "presets" / "embedded.sh").read_text()
                      + f'\nEXP_DIR={exp}\nBUILD_BASE_MODEL=0\nCOSYVOICE2_DIR={tiny_cosyvoice2[0]}\n'
                      f'HF_MODEL_DIR={exp}/hf_model\nDATA_DIR={exp}/data\nMERGED_DIR={exp}/merged\n'
                      f'EVAL_DIR={exp}/eval\nEXPORT_PATH={exp}/llm-new.pt\nEVAL_NPROC=1\n'
                      'EVAL_ARGS=(--backend sim --test-set "embedded_test=$TEST_FILE" --min-token-text-ratio 0 '
                      '--max-token-text-ratio 3 --limit 6 --threads 1 --resamples 200)\n')
    env = {**os.environ, "PRESET": str(preset), "OMP_NUM_THREADS": "1"}
    # the preset's prompt budget fits its own per-character tokenizer (20 tokens at most); the tiny
    # model's 1,024-entry tokenizer spends up to 45 on a prompt: stage 0 says so and how to widen it,
    # and the environment's MAX_PROMPT_LENGTH wins over the preset's
    r = subprocess.run(["bash", str(ROOT / "run.sh"), "-1", "0"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 1 and "more than --max_prompt_length 32" in r.stderr, r.stdout + r.stderr
    assert "MAX_PROMPT_LENGTH=N bash run.sh 0 0" in r.stderr, r.stderr
    env["MAX_PROMPT_LENGTH"] = "64"
    r = subprocess.run(["bash", str(ROOT / "run.sh"), "0", "0"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    dev = [json.loads(x)["text"] for x in (exp / "data" / "split" / "dev.jsonl").read_text().splitlines()]
    assert len(dev) == 64 and "dev set: 64 of 393 training rows held out" in r.stdout
    trained = [e["text"] for e in pq.read_table(exp / "data" / "train.parquet").column("extra_info").to_pylist()]
    assert len(trained) == 393 - 64 and not set(trained) & set(dev)  # nothing of the dev set is trained on

    for step in (20, 40):  # two "trained" steps: copies of the start model, step 40's bias shifted
        d = exp / "merged" / f"step_{step}"
        shutil.copytree(exp / "hf_model", d)
        if step == 40:
            sd = load_file(str(d / "model.safetensors"))
            key = next(k for k in sd if k.endswith("lm_head.bias"))
            sd[key] = sd[key] + 1.0
            save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        write_marker(d, {"step": step})
    r = subprocess.run(["bash", str(ROOT / "run.sh"), "4", "5"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((exp / "eval" / "summary.json").read_text())
    assert {(x["test_set"], x["role"]) for x in rows} == {("dev", "dev"), ("embedded_test", "test")}
    assert sorted({x["step"] for x in rows}) == [0, 20, 40]
    want = choose_step(rows)
    assert want["chosen_on"] == ["dev"]
    record = json.loads((exp / "llm-new.pt.selection.json").read_text())
    assert record["step"] == want["step"] and record["chosen_by"] == "dev set"
    assert f"exporting step {want['step']}: Stage 5 exports step {want['step']}: the lowest cer_utt_mean on the " \
           "dev set(s) dev" in r.stdout
    assert "dev set(s) dev" in (exp / "eval" / "report.md").read_text()


def test_export_step_without_a_summary_says_stage_4_has_not_run(tmp_path):
    """EXPORT_STEP with no stage-4 summary gave a bare "[Errno 2] No such file or directory"; now the message
    names the summary, the step asked for, and that stage 4 has not run."""
    summary = tmp_path / "eval" / "summary.json"
    out = tmp_path / "llm-new.pt"
    p = subprocess.run([sys.executable, str(ROOT / "huggingface_to_pretrained.py"), "--from-sweep", str(summary),
                        "--merged-dir", str(tmp_path / "merged"), "--start-model", str(tmp_path / "hf"),
                        "--step", "300", "--output-path", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith(f"error: no stage-4 summary {summary} (asked for step 300): "
                                                     "stage 4 has not run here"), p.stderr
    assert "[Errno 2]" not in p.stderr and not out.exists()
