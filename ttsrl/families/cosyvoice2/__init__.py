"""CosyVoice2-0.5B (``Qwen2LM`` of FunAudioLLM/CosyVoice, cosyvoice/llm/llm.py).

The LLM predicts one of 6564 classes: 0..6560 speech tokens, 6561 the end of speech, 6562 and
6563 further stop tokens (6563 is the "fill" token of bistream training). Its input side has
two learned vectors, ``llm_embedding`` rows 0 (sos) and 1 (task_id); its head has a bias. In
the Hugging Face checkpoint they become entries appended after the text tokenizer (Qwen's
plus CosyVoice's specials)::

    <|s_0|> .. <|s_6560|>   speech tokens        (LLM index 0..6560)
    <|eos1|>                the real end of speech (LLM index 6561)
    <|eos2|>, <|eos3|>      the other stop tokens (LLM index 6562, 6563)
    <|sos|>, <|task_id|>    the two input-only vectors of ``llm_embedding``

For the released model (Qwen2-0.5B tokenizer) the first speech id is 151663, the tokenizer has
158229 entries and the embedding is padded to 158336 rows.

Sampling rules (``ttsrl.model.cosyvoice_lm.pick_token`` runs them):

- ``cosyvoice2-2026`` (default): CosyVoice's current code, read at ace7c47 (2026-03-16).
  ``ras_sampling`` (cosyvoice/utils/common.py, commit f2ddcbe, 2026-02-04): when the nucleus pick
  already occurs >= win_size * tau_r times in the last win_size tokens, its score is set to -inf
  and a token is drawn from the full distribution of the remaining scores. ``sampling_ids``
  (cosyvoice/llm/llm.py, commit 0e62489, 2026-02-11): before the minimum length the score of row
  6561 (the trained eos) is -inf and one draw is made; 6562 and 6563 stay drawable and end the
  utterance when drawn. Both writes are in place on the step's scores.
- ``cosyvoice2-2024``: the rule before those commits, to reproduce older figures: the repeated
  pick is not blocked in the redraw, and before the minimum length any stop index is rejected and
  the whole draw repeated, at most max_trials times.
"""

from ttsrl.families.base import Family, Token2WavSpec

NAME = "cosyvoice2"
RELEASE = "CosyVoice2-0.5B"

# Special tokens CosyVoice adds to Qwen's tokenizer at run time, in order
# (cosyvoice/tokenizer/tokenizer.py: CosyVoice2Tokenizer).
COSYVOICE_SPECIALS = (
    "<|endofprompt|>", "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]",
    "<laughter>", "</laughter>", "[hissing]", "[sigh]", "[vocalized-noise]",
    "[lipsmack]", "[mn]",
)

FAMILY = Family(
    name=NAME, speech_token_size=6561, num_outputs=6564, eos_index=6561,
    output_names=("<|eos1|>", "<|eos2|>", "<|eos3|>"), input_names=("<|sos|>", "<|task_id|>"),
    sos_name="<|sos|>", task_id_name="<|task_id|>", head_bias=True, specials=COSYVOICE_SPECIALS,
    min_len_held=(6561,), rules=(("cosyvoice2-2026", "2026"), ("cosyvoice2-2024", "2024")),
    release=RELEASE,
    token2wav=Token2WavSpec("CosyVoice2", "cosyvoice2.yaml", "speech_tokenizer_v2.onnx", "CosyVoice2Model", RELEASE,
                        batch_flow=True,
                        # upstream README's download lines (ModelScope iic/..., Hugging Face FunAudioLLM/...)
                        hub_repo="FunAudioLLM/CosyVoice2-0.5B", modelscope_repo="iic/CosyVoice2-0.5B"),
)
