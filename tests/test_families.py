"""Model families (ttsrl.families: one folder each): CosyVoice3's layout through the vocabulary, the
conversion both ways, the HF class, the sampling rule and the generators; CosyVoice2's stays
as it was (its own tests, unchanged, run beside these).

CosyVoice3's weights cannot be had here: the checkpoints are random, in upstream's exact layout
(``CosyVoice3LM`` at FunAudioLLM/CosyVoice ace7c47: no llm_embedding, 6761-row speech embedding
and bias-free head)."""

import json
from pathlib import Path

import pytest
import torch
from draws import assert_fits

from ttsrl.model import vocab as V
from ttsrl.model.cosyvoice_lm import (
    Qwen2LM,
    SamplingConfig,
    check_rule_family,
    family_of_state,
    lm_class,
    pick_token,
    rule_distribution,
)

RULE_2026, RULE_COSYVOICE3 = "cosyvoice2-2026", "cosyvoice3-2026"
CosyVoice3LM = lm_class("cosyvoice3")

TEXTS = ["今天天气很好", "明天会下雨吗", "hello world"]


@pytest.fixture(scope="module")
def qwen_sized_tokenizer():
    from ttsrl.embedded.tiny_tokenizer import qwen_sized_tokenizer

    return qwen_sized_tokenizer()


def test_cosyvoice3_real_ids(qwen_sized_tokenizer):
    """On a tokenizer of Qwen2-0.5B's size: upstream's CosyVoice3Tokenizer ids (151924 text ids,
    <|endofprompt|> 151646, <|endofsystem|> 151663) and the speech rows after them."""
    tok = qwen_sized_tokenizer
    sv = V.extend_tokenizer(tok, "cosyvoice3")
    assert tok.convert_tokens_to_ids(["<|endofprompt|>", "[mn]", "<|endofsystem|>", "[AA]", "[ǜ]"]) == \
        [151646, 151662, 151663, 151664, 151923]
    assert sv.speech_offset == 151924 and sv.family is V.family("cosyvoice3")
    assert (sv.sos_id, sv.eos_id, sv.task_id) == (151924 + 6561, 151924 + 6562, 151924 + 6563)
    assert tok.convert_tokens_to_ids(["<|sos|>", "<|eos|>", "<|task_id|>", "<|fill|>", "<|x_6760|>"]) == \
        [158485, 158486, 158487, 158488, 158684]
    assert sv.stop_ids == list(range(158485, 158685)) and sv.output_range == (151924, 158685)
    assert len(tok) == sv.tokenizer_size == 158685 and sv.padded_vocab_size == 158720
    assert V.vocab_of(tok) == sv and V.extend_tokenizer(tok, "cosyvoice3") == sv  # found again; idempotent
    assert tok.eos_token == "<|eos|>"
    prompt = tok.apply_chat_template([{"role": "user", "content": "你好"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|sos|>You are a helpful assistant.<|endofprompt|>你好<|task_id|>"


def test_a_tokenizer_of_one_family_is_not_taken_for_the_other(qwen_sized_tokenizer):
    from ttsrl.embedded.tiny_tokenizer import qwen_sized_tokenizer as fresh

    tok2 = fresh()
    sv2 = V.extend_tokenizer(tok2, "cosyvoice2")
    assert V.vocab_of(tok2).family is V.family("cosyvoice2") and sv2.sos_id == 158227
    with pytest.raises(ValueError, match="cosyvoice3's special tokens"):
        V.extend_tokenizer(tok2, "cosyvoice3")  # CosyVoice2's speech rows sit where CosyVoice3's specials go


@pytest.fixture(scope="module")
def cv3(tmp_path_factory):
    from ttsrl.embedded.tiny_model import make_tiny_cosyvoice2
    from ttsrl.model.convert import cosyvoice_to_hf

    d = tmp_path_factory.mktemp("cv3")
    model = make_tiny_cosyvoice2(d / "pretrained", TEXTS, family="cosyvoice3")
    sv = cosyvoice_to_hf(d / "pretrained", d / "hf", log=lambda _: None)
    return d, model, sv


def test_cosyvoice3_llm_pt_has_upstreams_keys(cv3):
    d, model, _ = cv3
    state = torch.load(d / "pretrained" / "llm.pt", weights_only=True)
    assert "llm_embedding.weight" not in state and "llm_decoder.bias" not in state
    assert state["speech_embedding.weight"].shape[0] == state["llm_decoder.weight"].shape[0] == 6761
    assert "llm.model.lm_head.weight" in state and family_of_state(state) is V.family("cosyvoice3")
    assert isinstance(model, CosyVoice3LM)


def test_cosyvoice3_round_trip_is_bit_exact_and_recorded(cv3, tmp_path):
    from ttsrl.model.convert import hf_to_cosyvoice

    d, _, sv = cv3
    assert sv.family is V.family("cosyvoice3")
    cfg = json.loads((d / "hf" / "config.json").read_text())
    assert cfg["speech_family"] == "cosyvoice3" and cfg["speech_head_bias"] is False
    assert cfg["speech_output_range"] == [sv.speech_offset, sv.speech_offset + 6761]
    assert json.loads((d / "hf" / ".ttsrl-converted.json").read_text())["family"] == "cosyvoice3"
    hf_to_cosyvoice(d / "hf", tmp_path / "llm.pt", log=lambda _: None)
    a = torch.load(d / "pretrained" / "llm.pt", weights_only=True)
    b = torch.load(tmp_path / "llm.pt", weights_only=True)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_cosyvoice3_hf_logits_equal_the_reference_lm(cv3):
    """The converted checkpoint (our HF class, head without bias, non-speech logits masked)
    computes CosyVoice3LM's logits: sos and task_id come from speech_embedding rows 6561/6563."""
    from ttsrl.model.hf_model import load_speech_lm

    d, model, sv = cv3
    lm = load_speech_lm(d / "hf")
    assert lm.model.lm_head.bias is None and lm.vocab == sv
    text = lm.tokenizer.encode("You are a helpful assistant.<|endofprompt|>今天", add_special_tokens=False)
    speech = [1, 6560, 7, 7]
    ids = [sv.sos_id, *text, sv.task_id, *sv.codes_to_ids(speech)]
    with torch.no_grad():
        ours = lm.model(torch.tensor([ids])).logits[0]
        ref = model.forward_logits(text, speech)
    lo, hi = sv.output_range
    assert (ours[:, lo:hi] - ref).abs().max().item() < 1e-5  # fp32, same ops in another order
    assert (ours[:, :lo] == -1.0e4).all() and (ours[:, hi:] == -1.0e4).all()


def test_the_family_of_an_llm_pt_is_read_off_its_keys(cv3, tmp_path):
    d, _, _ = cv3
    state = dict(torch.load(d / "pretrained" / "llm.pt", weights_only=True))
    state["speech_embedding.weight"] = state["speech_embedding.weight"][:6600]
    assert family_of_state(state) is V.family("cosyvoice3")  # its keys; the shape check names the rows
    del state["speech_embedding.weight"]
    with pytest.raises(ValueError, match="matches no known family"):
        family_of_state(state)
    from ttsrl.model.convert import cosyvoice_to_hf

    with pytest.raises(ValueError, match="cosyvoice3 llm.pt"):
        cosyvoice_to_hf(d / "pretrained", tmp_path / "out", family="cosyvoice2", log=lambda _: None)


def test_cosyvoice3_rule_holds_every_stop_row_before_the_minimum_length():
    """Upstream's HF loop masks row 6561 (sos for CosyVoice3); ttsrl's cosyvoice3-2026 holds all
    200 stop rows, as upstream's vLLM path (min_tokens) does: no stop before min_len, ever."""
    fam = V.family("cosyvoice3")
    logp = torch.full((fam.num_outputs,), -30.0)
    logp[fam.eos_index], logp[6600], logp[5] = 0.0, -0.5, -3.0
    logp = logp.log_softmax(-1)
    cfg = SamplingConfig(rule=RULE_COSYVOICE3)
    before = rule_distribution(logp, [], False, cfg)
    assert float(before[fam.speech_token_size:].sum()) == 0.0 and float(before.sum()) == pytest.approx(1.0)
    g = torch.Generator().manual_seed(0)
    assert all(pick_token(logp, [], False, cfg, generator=g) < 6561 for _ in range(200))
    after = rule_distribution(logp, [], True, cfg)
    assert float(after[fam.eos_index]) > 0.5
    draws = [pick_token(logp, [], True, cfg, generator=g) for _ in range(1000)]
    support = {int(k): float(after[k]) for k in torch.nonzero(after > 0).flatten()}
    assert_fits(draws, {**support, "error": 0.0}, "cosyvoice3 after min_len")
    assert pick_token(logp, [], False, cfg, greedy=True) == 5


def test_a_rule_of_another_family_is_refused(cv3):
    from ttsrl.model.generate import GenerationConfig, HFGenerator, make_requests
    from ttsrl.model.hf_model import load_speech_lm

    check_rule_family(RULE_2026, V.family("cosyvoice2"))
    with pytest.raises(ValueError, match="--sampling-rule cosyvoice3-2026"):
        check_rule_family(RULE_2026, V.family("cosyvoice3"))
    d, _, _ = cv3
    lm = load_speech_lm(d / "hf")
    gen = HFGenerator(lm.model, lm.vocab)

    class U:
        id, text, prompt_text, prompt_speech = "u1", "今天", "", []

    reqs = make_requests(lm.tokenizer, [U])
    with pytest.raises(ValueError, match="cosyvoice2's"):
        gen.generate(reqs, GenerationConfig())


def test_cosyvoice3_generation_opens_with_the_instruction_and_equals_the_reference(cv3):
    """make_requests puts "You are a helpful assistant.<|endofprompt|>" first (CosyVoice3's
    frontend), and the batched generator's greedy codes equal CosyVoice3LM.inference's."""
    from ttsrl.model.generate import GenerationConfig, HFGenerator, build_input_ids, make_requests
    from ttsrl.model.hf_model import load_speech_lm

    d, model, sv = cv3
    lm = load_speech_lm(d / "hf")

    class U:
        id, text, prompt_text, prompt_speech = "u1", "今天天气", "明天", [3, 4, 5]

    req = make_requests(lm.tokenizer, [U])[0]
    prefix = lm.tokenizer.encode("You are a helpful assistant.<|endofprompt|>明天", add_special_tokens=False)
    assert req.prompt_text_ids == tuple(prefix) and 151646 not in prefix  # tiny tokenizer: its own id
    assert lm.tokenizer.convert_tokens_to_ids("<|endofprompt|>") in prefix
    ids = build_input_ids(sv, req)
    assert ids[0] == sv.sos_id and ids[-4] == sv.task_id and ids[-3:] == sv.codes_to_ids([3, 4, 5])
    cfg = GenerationConfig(greedy=True, sampling=SamplingConfig(rule=RULE_COSYVOICE3, max_token_text_ratio=5))
    got = HFGenerator(lm.model, lm.vocab).generate([req], cfg)[0]
    want = list(model.inference(req.text_ids, req.prompt_text_ids, req.prompt_speech, sampling=cfg.sampling,
                                greedy=True))
    assert got.error is None and got.codes == want


def test_cosyvoice2_reference_is_unchanged_by_the_family_layer(tiny_cosyvoice2):
    _, model = tiny_cosyvoice2
    assert type(model) is Qwen2LM and model.family is V.family("cosyvoice2")
    assert model.llm_decoder.bias is not None and model.llm_embedding.weight.shape[0] == 2
    assert V.SpeechVocab(100, V.family("cosyvoice2")).tokenizer_size == 100 + 6566


def test_stage_minus_1_cli_converts_an_rl_checkpoint_and_refuses_another_family(cv3, tmp_path, capsys):
    """pretrained_to_huggingface.py --llm llm.rl.pt (Fun-CosyVoice3 ships its RL checkpoint beside
    llm.pt) converts that file and records it; --family cosyvoice2 refuses a CosyVoice3 llm.pt."""
    import shutil

    import pretrained_to_huggingface as cli

    d, _, _ = cv3
    src = tmp_path / "Fun-CosyVoice3-0.5B"
    shutil.copytree(d / "pretrained", src)
    (src / "llm.pt").rename(src / "llm.rl.pt")
    assert cli.main(["--pretrained-path", str(src), "--save-path", str(tmp_path / "hf"), "--llm", "llm.rl.pt",
                     "--family", "cosyvoice3"]) == 0
    marker = json.loads((tmp_path / "hf" / ".ttsrl-converted.json").read_text())
    assert (marker["family"], marker["llm"]) == ("cosyvoice3", "llm.rl.pt")
    assert cli.main(["--pretrained-path", str(src), "--save-path", str(tmp_path / "hf2"), "--llm", "llm.rl.pt",
                     "--family", "cosyvoice2"]) == 2
    assert "is a cosyvoice3 llm.pt" in capsys.readouterr().err


def test_preference_pairs_in_cosyvoice3s_layout(cv3, tmp_path):
    """Your own pairs (read_user_pairs) get CosyVoice3's prompt, as mining builds it (the
    instruction first), and DPO's completions end with CosyVoice3's eos (6562), not 6561 (its sos)."""
    from ttsrl.model.generate import build_input_ids, make_requests
    from ttsrl.model.hf_model import load_speech_lm
    from ttsrl.train.dpo import pairs_to_rows
    from ttsrl.train.pairs import read_user_pairs

    d, _, sv = cv3
    lm = load_speech_lm(d / "hf")
    f = tmp_path / "pairs.jsonl"
    f.write_text(json.dumps({"id": "u1", "text": "今天", "chosen": [1, 2], "rejected": [3]}, ensure_ascii=False) + "\n")
    pair = read_user_pairs(f, lm.tokenizer)[0]

    class U:
        id, text, prompt_text, prompt_speech = "u1", "今天", "", []

    assert list(pair.prompt_ids) == build_input_ids(sv, make_requests(lm.tokenizer, [U])[0])
    assert lm.tokenizer.decode(pair.prompt_ids) == "<|sos|>You are a helpful assistant.<|endofprompt|>今天<|task_id|>"
    row = pairs_to_rows([pair], sv)[0]
    assert row["chosen_ids"] == sv.codes_to_ids([1, 2]) + [sv.speech_offset + 6562]


def test_a_step_of_another_family_is_refused_by_stage_4_and_5_naming_it(cv3, tiny_hf, tmp_path):
    """`EXPORT_STEP=41 bash run.sh 5 5` where merged/step_41 is a CosyVoice3 step of a cosyvoice2
    run said "to cosyvoice2's llm.pt" and wrote CosyVoice3's, exit 0; stage 4 scored two steps,
    then failed in torchrun naming nothing. Both now refuse up front, naming the step, its family
    and MODEL_FAMILY (run.sh passes --family to both), and write nothing."""
    import os
    import shutil
    import subprocess
    import sys

    from ttsrl.eval.evaluate import EvalConfig, models_to_score
    from ttsrl.model.checkpoint import FamilyMismatch, write_marker

    d, _, _ = cv3
    merged = tmp_path / "merged"
    shutil.copytree(tiny_hf, merged / "step_20")
    write_marker(merged / "step_20", {"step": 20})
    shutil.copytree(d / "hf", merged / "step_41")
    write_marker(merged / "step_41", {"step": 41})
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps([{"step": s, "test_set": "dev", "role": "dev", "cer_utt_mean": 0.5,
                                    "headline": "cer_utt_mean"} for s in (0, 20, 41)]))
    out = tmp_path / "llm-new.pt"
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, str(root / "huggingface_to_pretrained.py"), "--from-sweep", str(summary),
                        "--merged-dir", str(merged), "--start-model", str(tiny_hf), "--step", "41",
                        "--output-path", str(out), "--family", "cosyvoice2"], cwd=root, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2, p.stdout + p.stderr
    assert "step 41" in p.stderr and "is a cosyvoice3 model" in p.stderr and "family is cosyvoice2" in p.stderr, p.stderr
    assert "MODEL_FAMILY" in p.stderr and not out.exists()
    cfg = EvalConfig(start_model=str(tiny_hf), out_dir=str(tmp_path / "eval"), test_sets=[], merged_dir=str(merged),
                     family="cosyvoice2")
    with pytest.raises(FamilyMismatch, match=r"step 41 \(.*\) is a cosyvoice3 model, and this run's family is "
                                             "cosyvoice2"):
        models_to_score(cfg)
    assert sorted(models_to_score(EvalConfig(**{**cfg.__dict__, "steps": (0, 20)}))) == [0, 20]
