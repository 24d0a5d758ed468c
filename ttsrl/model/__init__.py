"""The CosyVoice2 speech-token LLM in every form (layer 1).

Owns the token ids (``vocab``: the only module that knows the vocabulary's numbers), the
``llm.pt`` <-> Hugging Face conversion (``convert``), the files of a model folder and of
the trained ``step_N`` folders with their ``MERGED.json`` marker, written atomically and
checked by one reader (``checkpoint``), the CosyVoice2-layout module
(``cosyvoice_lm``), the HF and vLLM model classes and vLLM's plugin and kernel check, and
generation with CosyVoice2's sampling rule (``generate``).

May import: the shared modules at ``ttsrl/`` top level. Nothing above.
"""
