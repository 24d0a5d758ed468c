"""Kokoro: a tiny speech LM whose speech tokens are Kokoro-82M's phonemes (the laptop's real-speech family).

No released model has this layout: it is the family of ``presets/speech_cpu.sh``, where a tiny
Qwen2-layout LM (the same ``Qwen2LM`` as CosyVoice2's, with its two input vectors in
``llm_embedding`` and a head with a bias) writes phonemes that a real neural voice speaks. Its
speech vocabulary (:mod:`ttsrl.families.kokoro.phonemes`) is 119 codes::

    <|s_0|> .. <|s_113|>     Kokoro's 114 phoneme symbols, in the order of their Kokoro ids
    <|s_114|> .. <|s_118|>   the five packaged voices (jf_alpha, jf_gongitsune, jf_nezumi,
                             jf_tebukuro, jm_kumo)
    <|eos1|>                 the end of speech (LLM index 119)
    <|sos|>, <|task_id|>     the two input-only vectors

An utterance is spoken in the voice of its first voice token, else in its row's voice: the LM
names the voice as a CosyVoice LM's tokens carry the speaker, so a policy can drift to another
voice and SIM against the row's voice sees it. Zero-shot rows prompt with a voice's token and a
short phrase in that voice (``data/kokoro/prompt_pool``).

Sampling rule ``kokoro-2026``: CosyVoice's current rule (as ``cosyvoice2-2026``) over this
vocabulary; the minimum length holds back the one stop row.

Token rate 13 phonemes a second at speed 1 (12 test sentences, voice jm_kumo: 13.06); Kokoro
speaks at 24 kHz.
"""

from ttsrl.families.base import Family
from ttsrl.families.cosyvoice2 import COSYVOICE_SPECIALS

NAME = "kokoro"
N_PHONEMES = 114
VOICES = ("jf_alpha", "jf_gongitsune", "jf_nezumi", "jf_tebukuro", "jm_kumo")

FAMILY = Family(
    name=NAME, speech_token_size=N_PHONEMES + len(VOICES), num_outputs=N_PHONEMES + len(VOICES) + 1,
    eos_index=N_PHONEMES + len(VOICES), output_names=("<|eos1|>",), input_names=("<|sos|>", "<|task_id|>"),
    sos_name="<|sos|>", task_id_name="<|task_id|>", head_bias=True, specials=COSYVOICE_SPECIALS,
    min_len_held=(N_PHONEMES + len(VOICES),), rules=(("kokoro-2026", "2026"),), token_rate_hz=13.0,
    sample_rate=24000,
)
