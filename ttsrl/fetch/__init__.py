"""Fetching the GPU recipe's inputs from their public homes (layer 3): ``python -m ttsrl.fetch``.

``inputs`` (what each input is, its source, where it goes; survey, fetch, the offline message),
``hub`` (Hugging Face through ``huggingface_hub``, ModelScope where installed; the one probe),
``layouts`` (hub datasets -> the layouts ``ttsrl.data.testsets`` and ``ttsrl.data.prompt_pool``
read), ``manifest`` (each input's record of source, size and sha256). run.sh runs it at the start of
stage -1 for the presets that set ``FETCH_ARGS`` (presets/gpu8.sh).

May import: layers 0-2 (``ttsrl.atomic``, ``ttsrl.families``); the hub clients lazily.
"""
