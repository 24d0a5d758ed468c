"""Exact conversion between a CosyVoice ``llm.pt`` (CosyVoice2 or CosyVoice3) and a Hugging
Face checkpoint. The family is read off the file's keys (``cosyvoice_lm.family_of_state``),
recorded in the checkpoint (config ``speech_family``, the converter's marker) and read back from
the tokenizer's entries (``vocab.vocab_of``).

``llm.pt`` -> HF (:func:`cosyvoice_to_hf`), N = the family's outputs (6564 / 6761):

    embed_tokens rows [0, offset)          <- llm.model.model.embed_tokens (text rows)
    embed_tokens rows offset + 0..N-1      <- speech_embedding (CosyVoice3: sos/task_id among them)
    embed_tokens rows sos_id, task_id      <- llm_embedding rows 0, 1 (CosyVoice2 only)
    lm_head.weight[/.bias] rows offset+0..N-1 <- llm_decoder.weight[/.bias] (others 0, masked;
                                              CosyVoice3's head has no bias)
    model.layers.*, model.norm.weight      <- llm.model.model.*

Inner-embedding rows at and beyond ``offset`` are unused by CosyVoice2 (no text id
reaches them) and have no place in the HF layout; they are kept in a side file
(``cosyvoice2_extra/inner_embed_tail.safetensors``) so that llm.pt -> HF -> llm.pt is
bit-exact. It sits in a sub-folder because vLLM loads every ``*.safetensors`` at the top
of a checkpoint folder as model weights.

Tensors are streamed: ``llm.pt`` is memory-mapped and the output is written in
safetensors shards, so peak memory stays near one copy of the model.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from ttsrl.atomic import atomic_dir, atomic_torch_save
from ttsrl.model import vocab as V
from ttsrl.model.checkpoint import (
    EXTRA_FILE,
    LEGACY_EXTRA_FILE,
    MARKER,
    MODELING_FILE,
    SHARD_BYTES,
    ShardWriter,
    read_hf_tensors,
    read_json_file,
)
from ttsrl.model.cosyvoice_lm import Qwen2LM, family_of_state, lm_class, load_llm_state_dict

ARCH = "CosyVoice2Qwen2ForCausalLM"
BLANK_EN = "CosyVoice-BlankEN"
CONVERTED_MARKER = ".ttsrl-converted.json"  # marks a folder written by cosyvoice_to_hf

INNER = "llm.model.model."


# ---- llm.pt -> HF ----------------------------------------------------------------

def load_blank_en(cosyvoice_dir: Path):
    from transformers import AutoConfig, AutoTokenizer

    blank = cosyvoice_dir / BLANK_EN
    if not (blank / "config.json").is_file():
        raise FileNotFoundError(f"{blank}/config.json not found: expected the released layout "
                                f"DIR/llm.pt + DIR/{BLANK_EN}/ (Qwen2 config and tokenizer)")
    read_json_file(blank / "config.json", "the Qwen2 config of CosyVoice-BlankEN")
    try:
        config = AutoConfig.from_pretrained(blank)
    except Exception as e:
        raise ValueError(f"{blank}/config.json: not a usable Qwen2 config ({type(e).__name__}: {e})") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(blank)
    except Exception as e:
        raise ValueError(f"{blank}: Qwen's tokenizer files cannot be loaded ({type(e).__name__}: {e})") from e
    return config, tokenizer


def is_converter_output(folder: Path) -> bool:
    """A folder this converter wrote: it has CONVERTED_MARKER, or (written before the
    marker existed) a config.json with our ``cosyvoice2_inner_vocab_size`` key and no
    stage-3 marker."""
    if (folder / CONVERTED_MARKER).is_file():
        return True
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "cosyvoice2_inner_vocab_size" in cfg and not (folder / MARKER).exists()


def check_output_path(source: Path, out: Path, force: bool = False) -> None:
    """Refuse an output the conversion must not replace: one that overlaps the input
    (is it, inside it, or holds it), a file, or a non-empty folder that is not a
    previous output of this converter (the last two allowed with ``force``)."""
    src, dst = Path(source).resolve(), Path(out).resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise ValueError(f"--save-path {out} overlaps the input folder {source}: the output folder is replaced "
                         "as a whole, which would delete the input. Choose a folder outside it.")
    if not (dst.exists() or dst.is_symlink()):
        return
    if not dst.is_dir():
        if not force:
            raise ValueError(f"--save-path {out} is an existing file; the output is a folder that would replace "
                             "it. Remove it, choose another path, or pass --force to replace it.")
        return
    entries = sorted(p.name for p in dst.iterdir())
    if entries and not is_converter_output(dst) and not force:
        raise ValueError(f"--save-path {out} is a non-empty folder ({len(entries)} entries, e.g. "
                         f"{', '.join(entries[:3])}) that is not an output of this converter; it would be "
                         "replaced as a whole. Choose a new or empty folder, or pass --force to replace it.")


def expected_llm_shapes(inner_config, fam: V.Family) -> dict[str, torch.Size]:
    """Key -> shape of the family's LM (``Qwen2LM``/``CosyVoice3LM``) for this inner config
    (built on the meta device)."""
    with torch.device("meta"):
        model = lm_class(fam)(inner_config)
    return {k: v.shape for k, v in model.state_dict().items()}


def check_llm_state(state: dict, inner_config, source: str, fam: V.Family) -> None:
    expected = expected_llm_shapes(inner_config, fam)
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing:
        raise ValueError(f"{source}: missing tensor {missing[0]!r} (and {len(missing) - 1} more); "
                         f"is this {fam.release}'s llm.pt for this CosyVoice-BlankEN config?")
    if extra:
        raise ValueError(f"{source}: unexpected tensor {extra[0]!r} (and {len(extra) - 1} more)")
    for k, shape in expected.items():
        if state[k].shape != shape:
            raise ValueError(f"{source}: tensor {k!r} has shape {tuple(state[k].shape)}, "
                             f"expected {tuple(shape)} for this config")


def hf_config_dict(inner_config, sv: V.SpeechVocab, pad_id: int, dtype: torch.dtype, stock: bool) -> dict:
    cfg = inner_config.to_dict()
    for k in ("auto_map", "_name_or_path", "transformers_version"):
        cfg.pop(k, None)
    cfg.update(
        model_type="qwen2",
        vocab_size=sv.padded_vocab_size,
        tie_word_embeddings=False,
        bos_token_id=sv.sos_id,
        eos_token_id=sv.stop_ids,
        pad_token_id=pad_id,
        dtype=str(dtype).removeprefix("torch."),
        cosyvoice2_inner_vocab_size=inner_config.vocab_size,
        speech_family=sv.family.name,
        speech_head_bias=sv.family.head_bias,
    )
    if stock:
        cfg["architectures"] = ["Qwen2ForCausalLM"]
    else:
        cfg["architectures"] = [ARCH]
        cfg["auto_map"] = {"AutoModelForCausalLM": f"{MODELING_FILE.stem}.{ARCH}"}
        cfg["speech_output_range"] = list(sv.output_range)
    return cfg


def generation_config_dict(sv: V.SpeechVocab, pad_id: int) -> dict:
    return {"bos_token_id": sv.sos_id, "eos_token_id": sv.stop_ids, "pad_token_id": pad_id,
            "do_sample": True, "top_p": 0.8, "top_k": 25}


def hf_tensors(state: dict, inner_config, sv: V.SpeechVocab, dtype, stock: bool):
    """Yield (name, tensor) of the HF checkpoint, one tensor at a time."""
    inner_vocab, hidden = state[INNER + "embed_tokens.weight"].shape
    if inner_vocab < sv.speech_offset:
        raise ValueError(f"inner embedding has {inner_vocab} rows but the tokenizer has "
                         f"{sv.speech_offset} text ids")
    lo, hi = sv.output_range

    embed = torch.zeros(sv.padded_vocab_size, hidden, dtype=dtype)
    embed[:lo] = state[INNER + "embed_tokens.weight"][:lo]
    embed[lo:hi] = state["speech_embedding.weight"]
    key, (sos_row, task_row) = sv.family.input_rows()
    if key == "llm_embedding.weight":  # else they are speech_embedding rows, copied above
        embed[sv.sos_id] = state[key][sos_row]
        embed[sv.task_id] = state[key][task_row]
    yield "model.embed_tokens.weight", embed
    del embed

    for k, t in state.items():
        if k.startswith(INNER) and k != INNER + "embed_tokens.weight":
            yield "model." + k[len(INNER):], t.to(dtype)

    head = torch.zeros(sv.padded_vocab_size, hidden, dtype=dtype)
    head[lo:hi] = state["llm_decoder.weight"]
    yield "lm_head.weight", head
    del head
    if not stock and sv.family.head_bias:
        bias = torch.zeros(sv.padded_vocab_size, dtype=dtype)
        bias[lo:hi] = state["llm_decoder.bias"]
        yield "lm_head.bias", bias


def cosyvoice_to_hf(cosyvoice_dir: str | Path, save_path: str | Path, dtype: torch.dtype = torch.float32,
                    stock: bool = False, shard_bytes: int = SHARD_BYTES,
                    log: Callable[[str], None] = print, force: bool = False,
                    family: str | None = None, llm_file: str = "llm.pt") -> V.SpeechVocab:
    """Convert ``DIR/llm.pt`` + ``DIR/CosyVoice-BlankEN`` into an HF checkpoint at
    ``save_path`` (written atomically; see :func:`check_output_path` for what it
    refuses to replace). The family is read off llm.pt (``family``: refuse any other).
    Returns the speech vocabulary."""
    from safetensors.torch import save_file

    cosyvoice_dir = Path(cosyvoice_dir)
    check_output_path(cosyvoice_dir, Path(save_path), force)
    inner_config, tokenizer = load_blank_en(cosyvoice_dir)
    llm_pt = cosyvoice_dir / llm_file
    state = load_llm_state_dict(llm_pt)
    fam = family_of_state(state)
    if family is not None and V.family(family) is not fam:
        raise ValueError(f"{llm_pt} is a {fam.name} llm.pt ({fam.upstream_class}), not {V.family(family).name}")
    check_llm_state(state, inner_config, str(llm_pt), fam)
    sv = V.extend_tokenizer(tokenizer, fam)
    log(f"{fam.name} speech vocabulary: <|s_0|>={sv.speech_offset}, eos={sv.eos_id}, sos={sv.sos_id}, "
        f"task_id={sv.task_id}, tokenizer {sv.tokenizer_size}, embedding {sv.padded_vocab_size}")

    with atomic_dir(save_path) as out:
        writer = ShardWriter(out, shard_bytes)
        for name, t in hf_tensors(state, inner_config, sv, dtype, stock):
            writer.add(name, t)
        writer.close()
        tail = state[INNER + "embed_tokens.weight"][sv.speech_offset:]
        (out / EXTRA_FILE).parent.mkdir()
        save_file({"inner_embed_tail": tail.contiguous()}, str(out / EXTRA_FILE), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(hf_config_dict(inner_config, sv, tokenizer.pad_token_id, dtype, stock), indent=2))
        (out / "generation_config.json").write_text(json.dumps(generation_config_dict(sv, tokenizer.pad_token_id), indent=2))
        tokenizer.save_pretrained(out)
        if not stock:
            shutil.copy2(MODELING_FILE, out / MODELING_FILE.name)
        (out / CONVERTED_MARKER).write_text(json.dumps(
            {"tool": "pretrained_to_huggingface.py", "family": fam.name, "source": str(cosyvoice_dir.resolve()),
             "llm": llm_file,
             "dtype": str(dtype).removeprefix("torch."), "stock_qwen2": stock}, indent=2))
    return sv


# ---- HF -> llm.pt ----------------------------------------------------------------

def inner_config_of(hf_config: dict):
    from transformers import Qwen2Config

    cfg = {k: v for k, v in hf_config.items()
           if k not in ("architectures", "auto_map", "speech_output_range", "cosyvoice2_inner_vocab_size",
                        "speech_family", "speech_head_bias", "bos_token_id", "eos_token_id", "pad_token_id")}
    cfg.update(vocab_size=hf_config.get("cosyvoice2_inner_vocab_size", hf_config["vocab_size"]),
               tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])
    return Qwen2Config(**cfg)


def hf_to_cosyvoice_state(hf_dir: str | Path, log: Callable[[str], None] = print) -> dict[str, torch.Tensor]:
    """Rebuild the family's ``llm.pt`` state dict (fp32) from an HF checkpoint."""
    from transformers import AutoTokenizer

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir}/config.json not found: is {hf_dir} a Hugging Face checkpoint folder?")
    hf_config = read_json_file(hf_dir / "config.json", "the model's Hugging Face config")
    sv = V.vocab_of(AutoTokenizer.from_pretrained(hf_dir))
    fam = sv.family
    if hf_config.get("speech_family", fam.name) != fam.name:
        raise ValueError(f"{hf_dir}: config.json says speech_family {hf_config['speech_family']!r} but the tokenizer "
                         f"holds {fam.name}'s vocabulary")
    inner = inner_config_of(hf_config)
    t = read_hf_tensors(hf_dir)
    f32 = torch.float32

    def need(name: str, shape: tuple) -> torch.Tensor:
        if name not in t:
            raise ValueError(f"{hf_dir}: tensor {name!r} missing")
        if tuple(t[name].shape) != tuple(shape):
            raise ValueError(f"{hf_dir}: tensor {name!r} has shape {tuple(t[name].shape)}, expected {tuple(shape)}")
        return t.pop(name).to(f32)

    lo, hi = sv.output_range
    H, P = inner.hidden_size, sv.padded_vocab_size
    embed = need("model.embed_tokens.weight", (P, H))
    head = need("lm_head.weight", (P, H))
    bias = t.pop("lm_head.bias", None)
    if not fam.head_bias:
        if bias is not None:
            raise ValueError(f"{hf_dir}: has an lm_head.bias, but {fam.name}'s llm_decoder has none")
    elif bias is None:
        log("warning: checkpoint has no lm_head.bias (stock Qwen2 layout): llm_decoder.bias is written as zeros")
        bias = torch.zeros(P)
    elif tuple(bias.shape) != (P,):
        raise ValueError(f"{hf_dir}: tensor 'lm_head.bias' has shape {tuple(bias.shape)}, expected {(P,)}")
    n_tail = inner.vocab_size - lo
    extra = hf_dir / EXTRA_FILE
    if not extra.is_file() and (hf_dir / LEGACY_EXTRA_FILE).is_file():
        extra = hf_dir / LEGACY_EXTRA_FILE
    if extra.is_file():
        from safetensors.torch import load_file

        tail = load_file(str(extra))["inner_embed_tail"].to(f32)
        if tuple(tail.shape) != (n_tail, H):
            raise ValueError(f"{extra}: tensor 'inner_embed_tail' has shape {tuple(tail.shape)}, expected {(n_tail, H)}")
    else:
        log(f"note: {EXTRA_FILE} absent: unused inner-embedding rows {lo}..{inner.vocab_size - 1} written as zeros")
        tail = torch.zeros(n_tail, H)

    inner_embed = torch.cat([embed[:lo], tail])
    state = {INNER + "embed_tokens.weight": inner_embed}
    if fam.input_embedding == "llm_embedding":
        state["llm_embedding.weight"] = torch.stack([embed[sv.sos_id], embed[sv.task_id]]).clone()
    for k in list(t):
        if k.startswith("model."):
            state[INNER + k[len("model."):]] = t.pop(k).to(f32)
    if t:
        raise ValueError(f"{hf_dir}: unexpected tensor {sorted(t)[0]!r}")
    state["llm.model.lm_head.weight"] = inner_embed  # tied in Qwen2LM's inner model
    state["llm_decoder.weight"] = head[lo:hi].clone()
    if fam.head_bias:
        state["llm_decoder.bias"] = bias[lo:hi].to(f32).clone()
    state["speech_embedding.weight"] = embed[lo:hi].clone()
    del embed, head
    check_llm_state(state, inner, str(hf_dir), fam)
    expected_order = list(expected_llm_shapes(inner, fam))
    return {k: state[k] for k in expected_order}


def hf_to_cosyvoice(hf_dir: str | Path, output_path: str | Path, log: Callable[[str], None] = print) -> None:
    if Path(output_path).is_dir():
        raise ValueError(f"--output-path {output_path} is a folder; it names the llm.pt file to write "
                         f"(e.g. {Path(output_path) / 'llm.pt'})")
    state = hf_to_cosyvoice_state(hf_dir, log)
    atomic_torch_save(state, output_path)


# ---- what a stock Qwen2 load loses ----------------------------------------------

@torch.no_grad()
def stock_head_loss(model: Qwen2LM, text_vocab: int, n_seqs: int = 8, text_len: int = 12,
                    speech_len: int = 48, seed: int = 0) -> dict[str, float]:
    """Compare the family's head with what a stock Qwen2 load of the converted
    checkpoint computes (no bias; non-speech rows at logit 0 instead of masked) on a
    random probe batch. Returns mean KL(ours || stock) per position (nats), the same
    with only the bias removed, and the probability mass stock puts on tokens that
    are not speech/stop tokens."""
    g = torch.Generator().manual_seed(seed)
    kls, kls_bias, leaks = [], [], []
    for _ in range(n_seqs):
        text = torch.randint(0, text_vocab, (text_len,), generator=g).tolist()
        fam = model.family
        speech = torch.randint(0, fam.speech_token_size, (speech_len,), generator=g).tolist()
        hidden, _ = model.llm(model.build_inputs(text, speech))
        h = hidden[0].float()
        ours = model.llm_decoder(h).log_softmax(-1)
        no_bias = h @ model.llm_decoder.weight.float().T
        n_other = V.SpeechVocab(text_vocab, fam).padded_vocab_size - fam.num_outputs
        # stock: the speech/stop rows without bias + n_other rows with logit exactly 0
        full = torch.cat([no_bias, torch.zeros(h.shape[0], n_other)], dim=-1).log_softmax(-1)
        stock = full[:, : fam.num_outputs]
        kls.append((ours.exp() * (ours - stock)).sum(-1))
        kls_bias.append((ours.exp() * (ours - no_bias.log_softmax(-1))).sum(-1))
        leaks.append(1 - stock.exp().sum(-1))
    return {"kl_stock": torch.cat(kls).mean().item(), "kl_no_bias": torch.cat(kls_bias).mean().item(),
            "non_speech_mass_stock": torch.cat(leaks).mean().item()}


def cosyvoice_own_lm(inner_config, family: V.Family) -> torch.nn.Module:
    """CosyVoice's own LM class of ``family`` (``family.upstream_class`` of ``cosyvoice.llm.llm``:
    ``Qwen2LM``, or ``CosyVoice3LM``, which only a CosyVoice source checkout has: import it first,
    ``ttsrl.reward.backends.cosyvoice_code.import_cosyvoice``) from the installed CosyVoice code
    (what CosyVoice's inference loads ``llm.pt`` into) around a Qwen2 body of ``inner_config``
    with random weights, for ``load_state_dict``: its ``Qwen2Encoder.__init__`` reads pretrained
    weights (``from_pretrained``) that a CosyVoice folder does not hold."""
    import cosyvoice.llm.llm as upstream  # type: ignore  # CosyVoice's code: not a ttsrl dependency
    from transformers import Qwen2ForCausalLM

    cls = getattr(upstream, family.upstream_class, None)
    if cls is None:
        raise ImportError(f"the installed CosyVoice code ({upstream.__file__}) has no {family.upstream_class} "
                          f"(the PyPI package predates {family.name}: a CosyVoice source checkout has it)")
    enc = upstream.Qwen2Encoder.__new__(upstream.Qwen2Encoder)
    nn.Module.__init__(enc)
    enc.model = Qwen2ForCausalLM(inner_config)
    return cls(llm_input_size=inner_config.hidden_size, llm_output_size=inner_config.hidden_size,
               speech_token_size=family.speech_token_size, llm=enc, sampling=None)


def cosyvoice_own_prefix(lm, text_ids: Sequence[int]) -> torch.Tensor:
    """The input CosyVoice's own class builds in its ``inference``, before any speech: sos, text
    embeddings, task id (rows of ``llm_embedding`` in ``Qwen2LM``, of ``speech_embedding`` in
    ``CosyVoice3LM``, which has no ``llm_embedding``), shape (n, hidden)."""
    if hasattr(lm, "llm_embedding"):
        emb, sos = lm.llm_embedding.weight, lm.sos_eos
    else:
        emb, sos = lm.speech_embedding.weight, lm.sos
    return torch.cat([emb[sos][None], lm.llm.model.model.embed_tokens(torch.tensor(list(text_ids))),
                      emb[lm.task_id][None]])


def cosyvoice_own_logits(lm, text_ids: Sequence[int], speech: Sequence[int]) -> torch.Tensor:
    """``forward_logits`` computed by CosyVoice's own class (``cosyvoice_own_lm``), its input
    built as its ``inference`` builds it: sos, text embeddings, task id, speech embeddings."""
    x = torch.cat([cosyvoice_own_prefix(lm, text_ids),
                   lm.speech_embedding(torch.tensor(list(speech), dtype=torch.long))])[None]
    hidden, _ = lm.llm(x, torch.tensor([x.shape[1]]))
    return lm.llm_decoder(hidden[0])


class CosyVoiceDecodeMismatch(RuntimeError):
    """CosyVoice's own cached decoding loop does not reproduce the checkpoint's greedy decode."""


#: the transformers release CosyVoice pins (its requirements.txt): its cached loop is right there
COSYVOICE_TRANSFORMERS = "4.51.3"


def cosyvoice_own_greedy(lm, text_ids: Sequence[int], steps: int) -> list[int]:
    """Greedy codes from CosyVoice's own ``Qwen2LM.inference_wrapper`` (its KV-cached
    ``forward_one_step`` loop, what CosyVoice's inference runs without vLLM), at most ``steps``."""
    x = cosyvoice_own_prefix(lm, text_ids)[None]
    lm.sampling = lambda scores, decoded, k: scores.argmax(dim=-1, keepdim=True)  # greedy, no RAS
    return [int(t) for t in lm.inference_wrapper(x, 25, 0, steps, "")]


def checkpoint_greedy(hf, sv: V.SpeechVocab, text_ids: Sequence[int], steps: int) -> tuple[list[int], bool]:
    """Greedy codes of the HF checkpoint by full forwards (no cache), stopping where CosyVoice's
    loop stops (eos), and whether the whole sequence is comparable: at one of the other two
    stop rows CosyVoice's loop re-feeds its last input (``continue``), so only the codes before
    it are (False)."""
    lo, hi = sv.output_range
    ids, out = [sv.sos_id, *text_ids, sv.task_id], []
    for _ in range(steps):
        idx = int(hf.model(torch.tensor([ids])).logits[0, -1, lo:hi].argmax())
        if idx == sv.eos_index:
            break
        if idx >= sv.speech_token_size:
            return out, False
        out.append(idx)
        ids = ids + sv.codes_to_ids([idx])
    return out, True


@torch.no_grad()
def verify_export(hf_dir: str | Path, llm_pt: str | Path, n_seqs: int = 4, seed: int = 0,
                  reference: str = "ttsrl", decode_steps: int = 8) -> float:
    """Max |logit difference| between the HF checkpoint and the exported llm.pt
    (loaded strictly into the family's LM class), both in fp32, over a random probe batch.
    ``reference``: "ttsrl" (``ttsrl.model.cosyvoice_lm``'s ``Qwen2LM``/``CosyVoice3LM``, no
    CosyVoice code needed) or "cosyvoice" (CosyVoice's own class from the installed CosyVoice
    code: ``cosyvoice_own_lm``; CosyVoice3's ``CosyVoice3LM`` only from a source checkout,
    imported first). With "cosyvoice" and CosyVoice2, equal logits are not enough:
    ``decode_steps`` greedy codes of each probe's text from CosyVoice's own cached loop must
    equal the checkpoint's, else
    :class:`CosyVoiceDecodeMismatch` (under transformers 5 that loop repeats one code: its
    ``forward_one_step`` hands a one-position attention mask, which transformers 5 takes as the
    whole mask; CosyVoice pins transformers 4.51.3). ``decode_steps=0``, and CosyVoice3: logits
    only."""
    import transformers

    from ttsrl.model.hf_model import load_speech_lm

    hf = load_speech_lm(hf_dir, dtype=torch.float32)
    sv = V.vocab_of(hf.tokenizer)
    inner = inner_config_of(json.loads((Path(hf_dir) / "config.json").read_text()))
    if reference == "cosyvoice":
        ref = cosyvoice_own_lm(inner, sv.family)
        logits_of = functools.partial(cosyvoice_own_logits, ref)
    elif reference == "ttsrl":
        ref = lm_class(sv.family)(inner)
        logits_of = ref.forward_logits
    else:
        raise ValueError(f"reference {reference!r}: expected 'ttsrl' or 'cosyvoice'")
    ref.load_state_dict(load_llm_state_dict(llm_pt), strict=True)
    ref.eval()
    g = torch.Generator().manual_seed(seed)
    lo, hi = sv.output_range
    worst = 0.0
    texts = []
    for _ in range(n_seqs):
        text = torch.randint(0, sv.text_vocab_size, (10,), generator=g).tolist()
        speech = torch.randint(0, sv.speech_token_size, (30,), generator=g).tolist()
        a = logits_of(text, speech)
        ids = [sv.sos_id] + text + [sv.task_id] + sv.codes_to_ids(speech)
        b = hf.model(torch.tensor([ids])).logits[0, :, lo:hi]
        worst = max(worst, (a - b).abs().max().item())
        texts.append(text)
    if reference == "cosyvoice" and decode_steps > 0 and sv.family.upstream_class == "Qwen2LM":  # the loop of upstream's Qwen2LM
        for text in texts:
            want, whole = checkpoint_greedy(hf, sv, text, decode_steps)
            got = cosyvoice_own_greedy(ref, text, decode_steps)
            if (got if whole else got[:len(want)]) != want:
                raise CosyVoiceDecodeMismatch(
                    f"CosyVoice's own cached decoding loop (Qwen2LM.inference_wrapper) under transformers "
                    f"{transformers.__version__} gives greedy codes {got} where the checkpoint gives {want} "
                    f"(the same logits: max |diff| {worst:.2e}). Run the exported llm.pt in CosyVoice's own "
                    f"environment (transformers {COSYVOICE_TRANSFORMERS}, its requirements.txt): under "
                    "transformers 5 its forward_one_step passes a one-position attention mask that is taken "
                    "as the whole mask.")
    return worst
