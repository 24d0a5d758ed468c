"""Fun-CosyVoice3-0.5B-2512 (``CosyVoice3LM`` at FunAudioLLM/CosyVoice ace7c47, cosyvoice/llm/llm.py).

No ``llm_embedding``: ``speech_embedding`` and the bias-free ``llm_decoder`` have 6761 rows
(speech_token_size + 200): 0..6560 speech, 6561 sos, 6562 the end of speech, 6563 task_id, 6564
fill, 6565..6760 unused; every index >= 6561 stops (its ``stop_token_ids``). All 6761 rows map
to HF entries::

    <|s_0|> .. <|s_6560|>                  speech tokens (0..6560)
    <|sos|> <|eos|> <|task_id|> <|fill|>   6561..6564 (sos and task_id are also inputs)
    <|x_6565|> .. <|x_6760|>               the unused stop rows

Its text tokenizer adds ``<|endofsystem|>``, ARPAbet and toned-pinyin tokens after CosyVoice2's
specials (151924 text ids on Qwen2-0.5B's tokenizer), and every text must hold
``<|endofprompt|>``: prompts start with "You are a helpful assistant.<|endofprompt|>".

Sampling rule ``cosyvoice3-2026``: the same ras_sampling and sampling_ids as CosyVoice2's current
rule, whose min-length write hits row 6561, which for CosyVoice3 is sos, not its eos (6562):
upstream's HF loop can stop before the minimum length on any of the 199 other stop rows, while
its vLLM path (SamplingParams min_tokens, stop_token_ids = all 200) cannot. This rule takes the
consistent reading: before the minimum length every stop row (6561..6760) is -inf, one draw.

Token2wav (DiT flow matching + causal HiFT; the shared engine ``ttsrl.reward.backends.cosyvoice``
reads :data:`FAMILY`'s spec): CosyVoice3's classes (``CosyVoice3Model``, ``CausalMaskedDiffWithDiT``,
``cosyvoice.flow.DiT``, ``CausalHiFTGenerator``) first appear together in upstream's dd2d926
(2025-08-20); the released folder goes with its code of December 2025 (56d9876 on); ttsrl is tested
against ace7c47. The PyPI cosyvoice-minicpmo (46dfe043, June 2025) predates it: a source checkout
is needed (``--cosyvoice-checkout``), and its DiT imports ``x_transformers``. The audio is 24 kHz,
960 samples per code (token_mel_ratio 2, hop 480). Its flow is voiced one utterance at a time (the
batched flow path is CosyVoice2's encoder: no ``batch_flow``).
"""

from ttsrl.families.base import Family, Token2WavSpec
from ttsrl.families.cosyvoice2 import COSYVOICE_SPECIALS

NAME = "cosyvoice3"
RELEASE = "Fun-CosyVoice3-0.5B-2512"
ENDOFPROMPT = "<|endofprompt|>"

# CosyVoice3Tokenizer's list after [mn] (upstream ace7c47): <|endofsystem|>, ARPAbet phones
# with stress digits, and toned pinyin finals/initials, in upstream's order (ids follow it).
_ARPABET = ("AA AA0 AA1 AA2 AE AE0 AE1 AE2 AH AH0 AH1 AH2 AO AO0 AO1 AO2 AW AW0 AW1 AW2 AY AY0 AY1 AY2 B CH D DH "
            "EH EH0 EH1 EH2 ER ER0 ER1 ER2 EY EY0 EY1 EY2 F G HH IH IH0 IH1 IH2 IY IY0 IY1 IY2 JH K L M N NG OW "
            "OW0 OW1 OW2 OY OY0 OY1 OY2 P R S SH T TH UH UH0 UH1 UH2 UW UW0 UW1 UW2 V W Y Z ZH")
_PINYIN = ("a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié iòng "
           "ióng iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh t u uang "
           "ue un uo uà uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi uǎn uǎng "
           "uǐ uǒ vè w x y z zh à ài àn àng ào á ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng ò òng "
           "òu ó óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo "
           "ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ")
COSYVOICE3_SPECIALS = COSYVOICE_SPECIALS + ("<|endofsystem|>",) + tuple(
    f"[{t}]" for t in (_ARPABET + " " + _PINYIN).split())

FAMILY = Family(
    name=NAME, speech_token_size=6561, num_outputs=6761, eos_index=6562,
    output_names=("<|sos|>", "<|eos|>", "<|task_id|>", "<|fill|>") + tuple(f"<|x_{i}|>" for i in range(6565, 6761)),
    input_names=(), sos_name="<|sos|>", task_id_name="<|task_id|>", head_bias=False, specials=COSYVOICE3_SPECIALS,
    min_len_held=tuple(range(6561, 6761)), rules=(("cosyvoice3-2026", "2026"),),
    system_prefix="You are a helpful assistant." + ENDOFPROMPT,
    input_embedding="speech_embedding", upstream_class="CosyVoice3LM", release=RELEASE,
    token2wav=Token2WavSpec("CosyVoice3", "cosyvoice3.yaml", "speech_tokenizer_v3.onnx", "CosyVoice3Model", RELEASE,
                        needs_code=(("cosyvoice/cli/model.py", "CosyVoice3Model"),
                                    ("cosyvoice/flow/flow.py", "CausalMaskedDiffWithDiT"),
                                    ("cosyvoice/flow/DiT/dit.py", "DiT"),
                                    ("cosyvoice/hifigan/generator.py", "CausalHiFTGenerator")),
                        since="dd2d926 (FunAudioLLM/CosyVoice, 2025-08-20; tested at ace7c47)",
                        # upstream README's ids (the code moved to QwenAudio/CosyVoice; the hub namespace stays)
                        hub_repo="FunAudioLLM/Fun-CosyVoice3-0.5B-2512",
                        modelscope_repo="FunAudioLLM/Fun-CosyVoice3-0.5B-2512", release_extras=("llm.rl.pt",)),
)
