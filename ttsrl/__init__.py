"""ttsrl: GRPO post-training for speech-token LLM text-to-speech (CosyVoice2 first).

The top-level scripts of the repository are thin CLIs over this package; see the
README's code map for which module owns what."""
