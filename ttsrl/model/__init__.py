"""The speech-token LLM of every family in every form (layer 1).

Owns the token ids of a tokenizer (``vocab``: a family's layout, ``ttsrl.families``, as ids), the
``llm.pt`` <-> Hugging Face conversion (``convert``), the files of a model folder and of
the trained ``step_N`` folders with their ``MERGED.json`` marker, written atomically and
checked by one reader (``checkpoint``), the CosyVoice2-layout module
(``cosyvoice_lm``), the HF and vLLM model classes and vLLM's plugin and kernel check, and
generation with CosyVoice2's sampling rule (``generate``).

May import: the shared modules at ``ttsrl/`` top level and ``ttsrl.families``. Nothing above.
"""
