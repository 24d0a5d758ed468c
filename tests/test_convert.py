"""llm.pt <-> HF conversion on a tiny random checkpoint of the exact real layout
(a fake of CosyVoice2's weights: see conftest.py)."""

import json
import shutil

import pytest
import torch
from helpers import run_main  # tests/helpers.py (tests/ is on sys.path)

from ttsrl.model import convert
from ttsrl.model.cosyvoice_lm import Qwen2LM
from ttsrl.model.hf_model import load_speech_lm


def hf_logits(lm, text_ids, speech):
    sv = lm.vocab
    ids = [sv.sos_id] + list(text_ids) + [sv.task_id] + sv.codes_to_ids(speech)
    with torch.no_grad():
        return lm.model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("text,speech", [("今天天气很好", []), ("银行的行长", [0, 17, 6560, 4000]),
                                         ("Hello world", list(range(0, 6561, 97)))])
def test_logits_parity_with_cosyvoice2(tiny_cosyvoice2, tiny_hf, text, speech):
    _, ref = tiny_cosyvoice2
    lm = load_speech_lm(tiny_hf)
    text_ids = lm.tokenizer.encode(text, add_special_tokens=False)
    with torch.no_grad():
        a = ref.forward_logits(text_ids, speech)
    b = hf_logits(lm, text_ids, speech)
    lo, hi = lm.vocab.output_range
    # the same float32 weights through two implementations (CosyVoice's Qwen2LM vs our HF class):
    # matmuls of another shape and attention of another kernel sum in other orders; logits of a
    # random model are O(10), so 1e-4 is ~100 eps of headroom on any CPU, and a wrong row or a lost
    # bias moves logits by O(0.1) (test_export_* below)
    assert (a - b[:, lo:hi]).abs().max().item() <= 1e-4
    # every other row is unreachable
    probs = b.softmax(-1)
    assert probs[:, :lo].sum().item() == 0.0 and probs[:, hi:].sum().item() == 0.0


def test_bias_is_kept(tiny_cosyvoice2, tiny_hf):
    """Parity holds only because the bias made it through: without it the logits differ."""
    _, ref = tiny_cosyvoice2
    lm = load_speech_lm(tiny_hf)
    lo, hi = lm.vocab.output_range
    assert torch.equal(lm.model.lm_head.bias[lo:hi], ref.llm_decoder.bias)
    assert ref.llm_decoder.bias.abs().max() > 0.01


def test_trust_remote_code_load_matches(tiny_hf):
    from transformers import AutoModelForCausalLM

    remote = AutoModelForCausalLM.from_pretrained(tiny_hf, trust_remote_code=True, dtype=torch.float32).eval()
    ours = load_speech_lm(tiny_hf)
    assert type(remote).__name__ == "CosyVoice2Qwen2ForCausalLM"
    ids = torch.tensor([[ours.vocab.sos_id, 5, 6, ours.vocab.task_id, ours.vocab.to_hf(3)]])
    with torch.no_grad():
        assert torch.equal(remote(ids).logits, ours.model(ids).logits)


def test_hf_generate_emits_only_speech(tiny_hf):
    lm = load_speech_lm(tiny_hf)
    sv = lm.vocab
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": "你好"}], add_generation_prompt=True,
                                              tokenize=False)
    ids = lm.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    torch.manual_seed(0)
    out = lm.model.generate(ids, max_new_tokens=40, do_sample=True, top_k=0, top_p=1.0, temperature=1.5)
    new = out[0, ids.shape[1]:].tolist()
    lo, hi = sv.output_range
    assert new and all(lo <= t < hi for t in new)


def test_round_trip_bit_exact(tiny_cosyvoice2, tiny_hf, tmp_path):
    d, _ = tiny_cosyvoice2
    out = tmp_path / "llm.pt"
    convert.hf_to_cosyvoice(tiny_hf, out, log=lambda _: None)
    a = torch.load(d / "llm.pt")
    b = torch.load(out)
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.float32
        assert torch.equal(a[k], b[k]), k
    # CosyVoice2 loads it strictly, with the inner lm_head tied as in the original
    from transformers import AutoConfig

    model = Qwen2LM(AutoConfig.from_pretrained(d / convert.BLANK_EN))
    model.load_state_dict(b, strict=True)
    assert b["llm.model.lm_head.weight"].data_ptr() == b["llm.model.model.embed_tokens.weight"].data_ptr()


def test_top_level_safetensors_hold_only_model_weights(tiny_hf):
    """vLLM loads every top-level ``*.safetensors`` as weights of the model: the side file
    with the unused inner-embedding rows must not be one of them (it made vLLM 0.24 fail
    with "no module or parameter named 'inner_embed_tail'")."""
    from safetensors import safe_open

    names = set()
    for f in tiny_hf.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            names |= set(h.keys())
    assert names and all(n.startswith(("model.", "lm_head.")) for n in names), sorted(names)[:5]
    assert (tiny_hf / convert.EXTRA_FILE).is_file()


def test_legacy_side_file_still_read(tiny_cosyvoice2, tiny_hf, tmp_path):
    """Folders written before the side file moved into a sub-folder still export exactly."""
    legacy = tmp_path / "legacy"
    shutil.copytree(tiny_hf, legacy)
    (legacy / convert.EXTRA_FILE).rename(legacy / convert.LEGACY_EXTRA_FILE)
    out = tmp_path / "llm.pt"
    convert.hf_to_cosyvoice(legacy, out, log=lambda _: None)
    a, b = torch.load(tiny_cosyvoice2[0] / "llm.pt"), torch.load(out)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sharded_bf16_reads(tiny_cosyvoice2, tmp_path):
    d, _ = tiny_cosyvoice2
    hf = tmp_path / "hf_bf16"
    convert.cosyvoice_to_hf(d, hf, dtype=torch.bfloat16, shard_bytes=200_000, log=lambda _: None)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    state = convert.hf_to_cosyvoice_state(hf, log=lambda _: None)
    orig = torch.load(d / "llm.pt")
    lo = load_speech_lm(hf).vocab.speech_offset
    for k in orig:  # bf16 rounding only; unused inner-embedding rows come from the exact side file
        want = orig[k].to(torch.bfloat16).float()
        if k.endswith("embed_tokens.weight") or k == "llm.model.lm_head.weight":
            want[lo:] = orig[k][lo:]
        assert torch.equal(state[k], want), k
    assert convert.verify_export(hf, _save(state, tmp_path / "x.pt")) == 0.0


def _save(state, path):
    torch.save(state, path)
    return path


def test_stock_qwen2_mode(tiny_cosyvoice2, tmp_path):
    from transformers import AutoModelForCausalLM

    d, ref = tiny_cosyvoice2
    out = tmp_path / "stock"
    sv = convert.cosyvoice_to_hf(d, out, stock=True, log=lambda _: None)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and "auto_map" not in cfg
    m = AutoModelForCausalLM.from_pretrained(out)  # no remote code needed
    assert m.lm_head.bias is None
    loss = convert.stock_head_loss(ref, sv.text_vocab_size)
    assert loss["kl_stock"] > loss["kl_no_bias"] > 0
    assert 0 < loss["non_speech_mass_stock"] < 1


def _copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_corrupt_llm_pt(tiny_cosyvoice2, tmp_path):
    d = _copy_checkpoint(tiny_cosyvoice2[0], tmp_path / "cv")
    (d / "llm.pt").write_bytes((d / "llm.pt").read_bytes()[:5000])
    with pytest.raises(ValueError, match="cannot be read as a PyTorch state dict"):
        convert.cosyvoice_to_hf(d, tmp_path / "out", log=lambda _: None)
    (d / "llm.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="llm.pt"):
        convert.cosyvoice_to_hf(d, tmp_path / "out", log=lambda _: None)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.pop("llm_decoder.bias"), "missing tensor 'llm_decoder.bias'"),
    (lambda s: s.__setitem__("extra.weight", torch.zeros(1)), "unexpected tensor 'extra.weight'"),
    (lambda s: s.__setitem__("speech_embedding.weight", torch.zeros(100, 64)),
     r"'speech_embedding.weight' has shape \(100, 64\), expected \(6564, 64\)"),
])
def test_mismatched_llm_pt(tiny_cosyvoice2, tmp_path, edit, message):
    d = _copy_checkpoint(tiny_cosyvoice2[0], tmp_path / "cv")
    state = torch.load(d / "llm.pt")
    edit(state)
    torch.save(state, d / "llm.pt")
    with pytest.raises(ValueError, match=message):
        convert.cosyvoice_to_hf(d, tmp_path / "out", log=lambda _: None)


def test_failed_conversion_keeps_existing_output(tiny_cosyvoice2, tiny_hf, tmp_path):
    out = _copy_checkpoint(tiny_hf, tmp_path / "hf")
    d = _copy_checkpoint(tiny_cosyvoice2[0], tmp_path / "cv")
    state = torch.load(d / "llm.pt")
    state.pop("llm_embedding.weight")
    torch.save(state, d / "llm.pt")
    with pytest.raises(ValueError):
        convert.cosyvoice_to_hf(d, out, log=lambda _: None)
    assert load_speech_lm(out).vocab.speech_offset > 0  # untouched, still loads
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.tmp")]


def test_export_rejects_mismatch(tiny_hf, tmp_path):
    from safetensors.torch import load_file, save_file

    hf = _copy_checkpoint(tiny_hf, tmp_path / "hf")
    t = load_file(hf / "model.safetensors")
    t["model.norm.weight"] = torch.ones(3)
    save_file(t, hf / "model.safetensors")
    with pytest.raises(ValueError, match=r"'llm.model.model.norm.weight' has shape \(3,\)"):
        convert.hf_to_cosyvoice(hf, tmp_path / "llm.pt", log=lambda _: None)
    assert not (tmp_path / "llm.pt").exists()


@pytest.mark.slow
def test_cli_round_trip(tiny_cosyvoice2, tmp_path):
    import subprocess
    import sys

    d, _ = tiny_cosyvoice2
    hf, pt = tmp_path / "hf", tmp_path / "llm.pt"
    r = subprocess.run([sys.executable, "pretrained_to_huggingface.py", "--pretrained-cosyvoice2-path", str(d),
                        "--save-path", str(hf)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "huggingface_to_pretrained.py", "--hf-cosyvoice2-llm-path", str(hf),
                        "--output-path", str(pt), "--verify"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "max |logit difference|" in r.stdout
    r = subprocess.run([sys.executable, "pretrained_to_huggingface.py", "--pretrained-cosyvoice2-path",
                        str(tmp_path / "nowhere"), "--save-path", str(hf)], capture_output=True, text=True)
    assert r.returncode == 2 and "CosyVoice-BlankEN" in r.stderr


# ---- the converter never deletes what it did not create; clear messages ----

def _cli(*args):
    return run_main("pretrained_to_huggingface", *args)


def _tree(d):
    return sorted((p.relative_to(d).as_posix(), p.read_bytes() if p.is_file() else b"")
                  for p in d.rglob("*"))


@pytest.mark.slow  # CLI round trips: ~4-5 s per case
@pytest.mark.parametrize("where", ["same", "blank_en", "parent"])
def test_save_path_overlapping_input_is_refused(tiny_cosyvoice2, tmp_path, where):
    d = _copy_checkpoint(tiny_cosyvoice2[0], tmp_path / "parent" / "cv")
    before = _tree(tmp_path)
    save = {"same": d, "blank_en": d / convert.BLANK_EN, "parent": tmp_path / "parent"}[where]
    for extra in ([], ["--force"]):  # not even with --force
        r = _cli("--pretrained-cosyvoice2-path", d, "--save-path", save, *extra)
        assert r.returncode == 2 and "overlaps the input folder" in r.stderr, r.stderr
    assert _tree(tmp_path) == before  # llm.pt and CosyVoice-BlankEN/ still there, nothing added


@pytest.mark.slow  # CLI round trips: ~30 s
def test_save_path_foreign_folder_or_file_needs_force(tiny_cosyvoice2, tmp_path):
    d, _ = tiny_cosyvoice2
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    r = _cli("--pretrained-cosyvoice2-path", d, "--save-path", foreign)
    assert r.returncode == 2 and "not an output of this converter" in r.stderr and "thesis.tex" in r.stderr
    assert (foreign / "thesis.tex").read_text() == "years of work"

    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me")
    r = _cli("--pretrained-cosyvoice2-path", d, "--save-path", a_file)
    assert r.returncode == 2 and "is an existing file" in r.stderr and a_file.read_text() == "keep me"

    # an earlier output of the converter is replaced without --force; so is an empty folder
    out = tmp_path / "hf"
    (out).mkdir()
    assert _cli("--pretrained-cosyvoice2-path", d, "--save-path", out).returncode == 0
    assert (out / convert.CONVERTED_MARKER).is_file()
    assert _cli("--pretrained-cosyvoice2-path", d, "--save-path", out).returncode == 0

    # --force replaces a file and leaves no stale .NAME.old-PID behind
    r = _cli("--pretrained-cosyvoice2-path", d, "--save-path", a_file, "--force")
    assert r.returncode == 0, r.stderr
    assert a_file.is_dir() and (a_file / "config.json").is_file()
    assert not [p.name for p in tmp_path.iterdir() if ".old-" in p.name or ".tmp-" in p.name]


@pytest.mark.slow  # CLI round trip: ~7 s
def test_blank_en_config_not_json(tiny_cosyvoice2, tmp_path):
    d = _copy_checkpoint(tiny_cosyvoice2[0], tmp_path / "cv")
    (d / convert.BLANK_EN / "config.json").write_text('{"hidden_size": 64,')
    r = _cli("--pretrained-cosyvoice2-path", d, "--save-path", tmp_path / "out")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{convert.BLANK_EN}/config.json: not valid JSON (line 1" in r.stderr, r.stderr


def _export(hf, out):
    return run_main("huggingface_to_pretrained", "--hf-cosyvoice2-llm-path", hf, "--output-path", out)


@pytest.mark.slow  # CLI round trips: ~22 s
def test_export_messages_name_the_file(tiny_cosyvoice2, tiny_hf, tmp_path):
    hf = _copy_checkpoint(tiny_hf, tmp_path / "hf")
    # --output-path that is a folder
    (tmp_path / "outdir").mkdir()
    r = _export(hf, tmp_path / "outdir")
    assert r.returncode == 2 and "is a folder" in r.stderr and "Traceback" not in r.stderr, r.stderr
    # a truncated shard
    w = hf / "model.safetensors"
    w.write_bytes(w.read_bytes()[:4000])
    r = _export(hf, tmp_path / "llm.pt")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{w}: cannot be read as safetensors" in r.stderr, r.stderr
    # a shard index that is not JSON
    sharded = tmp_path / "sharded"
    convert.cosyvoice_to_hf(tiny_cosyvoice2[0], sharded, shard_bytes=1 << 16, log=lambda _: None)
    index = sharded / "model.safetensors.index.json"
    index.write_text("weight_map: oops")
    r = _export(sharded, tmp_path / "llm.pt")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{index}: not valid JSON" in r.stderr, r.stderr
    assert not (tmp_path / "llm.pt").exists()


def test_export_loads_strict_in_cosyvoices_own_qwen2lm(tiny_cosyvoice2, tiny_hf, tmp_path):
    """Stage 5's llm.pt in CosyVoice's own Qwen2LM (the installed CosyVoice code, what CosyVoice's
    inference loads it into; not ttsrl's reimplementation): strict load, and its logits equal the
    HF checkpoint's. A changed output bias is seen; a missing key refuses to load."""
    d, _ = tiny_cosyvoice2
    out = tmp_path / "llm.pt"
    convert.hf_to_cosyvoice(tiny_hf, out, log=lambda _: None)
    # identical tensors on both sides: only the two forward implementations' sum orders differ
    # (the tiny model's logits are O(1)); a changed bias shows as > 1e-3 just below
    assert convert.verify_export(tiny_hf, out, reference="cosyvoice", decode_steps=0) <= 1e-5
    state = torch.load(out)
    state["llm_decoder.bias"] = state["llm_decoder.bias"] + 0.01 * torch.randn_like(state["llm_decoder.bias"])
    assert convert.verify_export(tiny_hf, _save(state, tmp_path / "bias.pt"), reference="cosyvoice",
                                 decode_steps=0) > 1e-3
    del state["speech_embedding.weight"]
    with pytest.raises(RuntimeError, match="speech_embedding.weight"):
        convert.verify_export(tiny_hf, _save(state, tmp_path / "missing.pt"), reference="cosyvoice")
    with pytest.raises(ValueError, match="reference"):
        convert.verify_export(tiny_hf, out, reference="upstream")


def test_export_check_decodes_with_cosyvoices_cached_loop(tiny_hf, tmp_path, monkeypatch):
    """Equal logits are not enough: verify_export(reference="cosyvoice") also decodes
    greedily with CosyVoice's own KV-cached loop. Under transformers 5 that loop repeats one code
    (its forward_one_step passes a one-position mask, taken as the whole mask), and the check says
    so, naming CosyVoice's pinned transformers; with that one line mended (the mask over the whole
    sequence, cache included) the same loop gives the checkpoint's codes and the check passes."""
    import transformers
    from cosyvoice.llm.llm import Qwen2Encoder

    out = tmp_path / "llm.pt"
    convert.hf_to_cosyvoice(tiny_hf, out, log=lambda _: None)
    major = int(transformers.__version__.split(".")[0])
    if major >= 5:
        with pytest.raises(convert.CosyVoiceDecodeMismatch, match="transformers 4.51.3") as e:
            convert.verify_export(tiny_hf, out, reference="cosyvoice")
        assert f"transformers {transformers.__version__}" in str(e.value)

    def forward_one_step(self, xs, masks, cache=None):  # the mask over cache + new positions
        seen = 0 if cache is None else cache.get_seq_length()
        full = torch.ones(1, seen + xs.shape[1], dtype=torch.bool)
        outs = self.model(inputs_embeds=xs, attention_mask=full, output_hidden_states=True, return_dict=True,
                          use_cache=True, past_key_values=cache)
        return outs.hidden_states[-1], outs.past_key_values

    monkeypatch.setattr(Qwen2Encoder, "forward_one_step", forward_one_step)
    assert convert.verify_export(tiny_hf, out, reference="cosyvoice", decode_steps=8) <= 1e-5
