"""The CPU world of the embedded preset (layer 2): the simulated speech codec (``codec``),
the tiny tokenizer and model of CosyVoice2's layout, and their pretraining (stage -1's
``BUILD_BASE_MODEL=1``). Nothing here is used by a real CosyVoice2 run except the ``sim``
reward backend, which decodes the codec.

May import: ``ttsrl.model`` and the shared top-level modules.
"""
