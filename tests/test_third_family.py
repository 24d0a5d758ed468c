"""A third family through the door: a toy family registered here (another speech vocabulary size and
rate, another stop set, no head bias) runs conversion both ways, the HF class, its sampling rule,
stage 0's rows and the reward protocol, with nothing of ttsrl edited for it.

What a real third family adds is a folder ``ttsrl/families/<name>/`` defining ``FAMILY`` and one
``register`` line in ``ttsrl/families/__init__.py``; this test registers its family in-process
instead, the same call, and takes it out again."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import requests
import torch

from ttsrl.families import FAMILIES, Family, family, family_of_state, register
from ttsrl.families.cosyvoice2 import COSYVOICE_SPECIALS
from ttsrl.model import vocab as V

TEXTS = ["今天天气很好", "明天会下雨吗", "我想喝一杯热茶"]
TOY = Family(
    name="toy", speech_token_size=300, num_outputs=304, eos_index=301,
    output_names=("<|toy_stop|>", "<|toy_eos|>", "<|toy_fill|>", "<|toy_pause|>"),
    input_names=("<|toy_sos|>", "<|toy_task|>"), sos_name="<|toy_sos|>", task_id_name="<|toy_task|>",
    head_bias=False, specials=COSYVOICE_SPECIALS, min_len_held=(300, 301, 302, 303),
    rules=(("toy-2026", "2026"),), token_rate_hz=12.5, upstream_class="ToyLM")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The toy family registered, a random llm.pt of its layout and its conversion."""
    from ttsrl.embedded.tiny_model import make_tiny_cosyvoice2
    from ttsrl.model.convert import cosyvoice_to_hf

    register(TOY)
    try:
        d = tmp_path_factory.mktemp("toy")
        model = make_tiny_cosyvoice2(d / "pretrained", TEXTS, family="toy")
        sv = cosyvoice_to_hf(d / "pretrained", d / "hf", log=lambda _: None)
        yield d, model, sv
    finally:
        FAMILIES.pop("toy", None)


def test_its_llm_pt_is_its_own_and_converts_both_ways_bit_exact(toy, tmp_path):
    from ttsrl.model.convert import hf_to_cosyvoice

    d, model, sv = toy
    state = torch.load(d / "pretrained" / "llm.pt", weights_only=True)
    assert type(model).__name__ == "ToyLM" and model.family is TOY
    assert state["speech_embedding.weight"].shape[0] == state["llm_decoder.weight"].shape[0] == 304
    assert "llm_embedding.weight" in state and "llm_decoder.bias" not in state
    assert family_of_state(state) is TOY  # read off its keys, beside cosyvoice2's and cosyvoice3's
    assert sv.family is TOY and sv.tokenizer_size == sv.speech_offset + 306
    cfg = json.loads((d / "hf" / "config.json").read_text())
    assert cfg["speech_family"] == "toy" and cfg["speech_output_range"] == [sv.speech_offset, sv.speech_offset + 304]
    hf_to_cosyvoice(d / "hf", tmp_path / "llm.pt", log=lambda _: None)
    back = torch.load(tmp_path / "llm.pt", weights_only=True)
    assert list(back) == list(state) and all(torch.equal(back[k], state[k]) for k in state)


def test_its_hf_class_computes_its_lm_and_masks_everything_else(toy):
    from ttsrl.model.hf_model import load_speech_lm

    d, model, sv = toy
    lm = load_speech_lm(d / "hf")
    assert lm.vocab == sv and lm.model.lm_head.bias is None
    text = lm.tokenizer.encode(TEXTS[0], add_special_tokens=False)
    speech = [0, 299, 7, 7]
    ids = [sv.sos_id, *text, sv.task_id, *sv.codes_to_ids(speech)]
    with torch.no_grad():
        ours = lm.model(torch.tensor([ids])).logits[0]
        ref = model.forward_logits(text, speech)
    lo, hi = sv.output_range
    assert (ours[:, lo:hi] - ref).abs().max().item() < 1e-5  # fp32, the same ops in another order
    assert (ours[:, :lo] == -1.0e4).all() and (ours[:, hi:] == -1.0e4).all()
    with pytest.raises(ValueError, match="outside 0..299"):
        sv.codes_to_ids([300])


def test_its_rule_holds_its_stop_rows_and_its_generators_stop_on_them(toy):
    from ttsrl.model.cosyvoice_lm import SamplingConfig, check_rule_family, pick_token

    _, model, _ = toy
    cfg = SamplingConfig(rule="toy-2026")
    logp = torch.full((304,), -30.0)
    logp[301] = 0.0  # the model wants to stop at once
    g = torch.Generator().manual_seed(0)
    assert all(pick_token(logp, [], False, cfg, generator=g) < 300 for _ in range(50))
    assert pick_token(logp, [], True, cfg, generator=g) == 301
    check_rule_family("toy-2026", TOY)
    with pytest.raises(ValueError, match="toy's"):
        check_rule_family("toy-2026", family("cosyvoice2"))
    codes = list(model.inference([3, 4, 5], sampling=cfg, generator=torch.Generator().manual_seed(1)))
    assert 3 * 2 <= len(codes) <= 3 * 20 and all(0 <= c < 300 for c in codes)


def test_stage_0_renders_its_template(toy, tmp_path):
    from ttsrl.data.prepare import PrepareConfig, prepare

    d, _, sv = toy
    rows = [{"text": t} for t in TEXTS]
    for name in ("train", "test"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                                encoding="utf-8")
    prepare(PrepareConfig(train_file=tmp_path / "train.jsonl", test_file=tmp_path / "test.jsonl",
                          local_dir=tmp_path / "data", tokenizer=d / "hf", allow_leak=True, progress=False))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d / "hf")
    assert V.vocab_of(tok) == sv
    row = pq.read_table(tmp_path / "data" / "train.parquet").to_pylist()[0]
    rendered = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    assert rendered == f"<|toy_sos|>{row['prompt'][0]['content']}<|toy_task|>"
    ids = tok.encode(rendered, add_special_tokens=False)
    assert ids[0] == sv.sos_id and ids[-1] == sv.task_id


def test_the_reward_server_checks_codes_against_its_family(toy):
    from ttsrl.reward.health import metadata
    from ttsrl.reward.server import BackgroundServer, ServerConfig

    def ask(url, codes):
        payload = {"inputs": [
            {"name": "TOKENS", "shape": [1, len(codes)], "datatype": "INT32", "data": [codes]},
            {"name": "TOKEN_LENS", "shape": [1, 1], "datatype": "INT32", "data": [[len(codes)]]},
            {"name": "GT_TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [TEXTS[0]]}]}
        return requests.post(f"{url}/v2/models/token2wav_asr/infer", json=payload, timeout=60)

    with BackgroundServer(ServerConfig(port=0, family="toy")) as srv:
        assert metadata(srv.url)["family"] == "toy"  # part of the identity a run adopts a server by
        assert ask(srv.url, [1, 2, 299]).status_code == 200
        r = ask(srv.url, [1, 2, 300])
        assert r.status_code == 400 and "outside 0..299" in r.text
