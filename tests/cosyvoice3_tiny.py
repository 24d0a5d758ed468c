"""A random-weight Fun-CosyVoice3-0.5B LLM folder of the released layout.

Fun-CosyVoice3-0.5B-2512's weights cannot be had here; ``write_random_llm3`` writes what its
LLM side has: ``llm.pt`` with the key names of upstream's ``CosyVoice3LM`` (FunAudioLLM/CosyVoice
ace7c47, cosyvoice/llm/llm.py) and ``CosyVoice-BlankEN/`` (a Qwen2 config and a tokenizer of
Qwen2's exact size, so that CosyVoice3Tokenizer's specials land on the real ids:
``<|endofprompt|>`` 151646, ``<|endofsystem|>`` 151663, 151924 entries in all).

The key names are derived here from upstream's module tree, not from ttsrl's own LM class (the
parity tests compare ttsrl against an independent implementation, so the fixture must not be
ttsrl's idea of the layout): ``CosyVoice3LM.llm`` is a ``Qwen2Encoder`` whose ``.model`` is a
``Qwen2ForCausalLM`` (``llm.model.model.*``, ``llm.model.lm_head.weight``, tied to the embedding
as released), ``llm_decoder`` a bias-free Linear(H, 6761) and ``speech_embedding`` an
Embedding(6761, H) (its ``criterion_ce`` has no parameters). Full size: 293 keys, 506.1M values.

``size``: "tiny" keeps the real vocabulary layout (151936 text rows, 6761 speech rows) with a
small body (hidden 64, 2 layers: ~40 MB, seconds to write); "full" is Qwen2-0.5B's dims (~2 GB).
The token2wav files (cosyvoice3.yaml, flow.pt, hift.pt) are not written here.
Used by tests/test_omni_parity.py.
"""

from __future__ import annotations

from pathlib import Path

SPEECH_TOKEN_SIZE = 6561
NUM_OUTPUTS = SPEECH_TOKEN_SIZE + 200  # CosyVoice3LM: llm_decoder / speech_embedding rows
ENDOFPROMPT_ID = 151646
ENDOFSYSTEM_ID = 151663
TOKENIZER_SIZE = 151924  # Qwen2's 151646 entries + CosyVoice3Tokenizer's 278 specials


def tiny_qwen2_config():
    """Qwen2-0.5B's vocabulary and head layout (151936 rows, tied text head) on a small body."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       architectures=["Qwen2ForCausalLM"])


def upstream_llm_shapes(cfg) -> dict:
    """Key -> shape of upstream CosyVoice3LM's state dict for a Qwen2 config (built on meta)."""
    import torch
    from torch import nn
    from transformers import Qwen2ForCausalLM

    class Qwen2Encoder(nn.Module):  # upstream cosyvoice/llm/llm.py: self.model = Qwen2ForCausalLM
        def __init__(self):
            super().__init__()
            self.model = Qwen2ForCausalLM(cfg)

    class CosyVoice3LM(nn.Module):  # upstream's parameter tree (criterion_ce: no parameters)
        def __init__(self):
            super().__init__()
            self.llm = Qwen2Encoder()
            self.llm_decoder = nn.Linear(cfg.hidden_size, NUM_OUTPUTS, bias=False)
            self.speech_embedding = nn.Embedding(NUM_OUTPUTS, cfg.hidden_size)

    with torch.device("meta"):
        m = CosyVoice3LM()
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    # transformers may leave a tied head out of state_dict(); upstream's torch.save of the module has it
    shapes.setdefault("llm.model.lm_head.weight", shapes["llm.model.model.embed_tokens.weight"])
    return shapes


def cosyvoice3_tokenizer_specials() -> list[str]:
    """Upstream CosyVoice3Tokenizer's additional_special_tokens (ace7c47), in its order.

    Written out here, not read from ttsrl.model.vocab (the tests compare ttsrl's list with it)."""
    arpabet = ("AA AA0 AA1 AA2 AE AE0 AE1 AE2 AH AH0 AH1 AH2 AO AO0 AO1 AO2 AW AW0 AW1 AW2 AY AY0 AY1 AY2 B CH D "
               "DH EH EH0 EH1 EH2 ER ER0 ER1 ER2 EY EY0 EY1 EY2 F G HH IH IH0 IH1 IH2 IY IY0 IY1 IY2 JH K L M N NG "
               "OW OW0 OW1 OW2 OY OY0 OY1 OY2 P R S SH T TH UH UH0 UH1 UH2 UW UW0 UW1 UW2 V W Y Z ZH")
    pinyin = ("a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié "
              "iòng ióng iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh "
              "t u uang ue un uo uà uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ "
              "uǎi uǎn uǎng uǐ uǒ vè w x y z zh à ài àn àng ào á ái án áng áo è èi èn èng èr é éi én éng ér ì ìn "
              "ìng í ín íng ò òng òu ó óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng "
              "ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ")
    return ["<|im_start|>", "<|im_end|>", "<|endofprompt|>",
            "[breath]", "<strong>", "</strong>", "[noise]", "[laughter]", "[cough]", "[clucking]", "[accent]",
            "[quick_breath]", "<laughter>", "</laughter>", "[hissing]", "[sigh]", "[vocalized-noise]",
            "[lipsmack]", "[mn]", "<|endofsystem|>",
            *(f"[{t}]" for t in (arpabet + " " + pinyin).split())]


def upstream_tokenizer(blank_en: str | Path):
    """What upstream's CosyVoice3Tokenizer does to CosyVoice-BlankEN's tokenizer (transformers)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(blank_en))
    tok.add_special_tokens({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                            "additional_special_tokens": cosyvoice3_tokenizer_specials()})
    return tok


def write_random_llm3(d: Path, seed: int = 0, size: str = "tiny") -> Path:
    """``d/llm.pt`` (upstream CosyVoice3LM key names; random weights N(0, 0.02), RMSNorm weights
    1, ``llm_decoder`` N(0, 0.1) so that its logits are peaked, the inner text head tied to the
    embedding) and ``d/CosyVoice-BlankEN/`` (config + Qwen-sized synthetic tokenizer). Returns
    ``d/llm.pt``."""
    import torch
    from cosyvoice2_tiny import qwen2_05b_config

    from ttsrl.atomic import atomic_torch_save
    from ttsrl.embedded.tiny_tokenizer import qwen_sized_tokenizer

    cfg = {"tiny": tiny_qwen2_config, "full": qwen2_05b_config}[size]()
    blank = d / "CosyVoice-BlankEN"
    d.mkdir(parents=True, exist_ok=True)
    qwen_sized_tokenizer().save_pretrained(blank)
    cfg.save_pretrained(blank)
    g = torch.Generator().manual_seed(seed)
    state = {k: (torch.ones(s) if k.endswith("norm.weight") else torch.randn(s, generator=g) * 0.02)
             for k, s in sorted(upstream_llm_shapes(cfg).items()) if k != "llm.model.lm_head.weight"}
    state["llm.model.lm_head.weight"] = state["llm.model.model.embed_tokens.weight"]  # tied, as released
    state["llm_decoder.weight"] *= 5.0
    atomic_torch_save(state, d / "llm.pt")
    return d / "llm.pt"
