"""vLLM plugin: registers CosyVoice2's biased, masked speech head for GPU rollouts.

Declared in pyproject.toml under the ``vllm.general_plugins`` entry point, so every
vLLM process (verl's rollout workers included) calls :func:`register` at start-up.
The converted checkpoint's ``architectures`` is ``CosyVoice2Qwen2ForCausalLM``;
without this registration vLLM would fall back to its generic Transformers backend
(mapping the name onto native ``Qwen2ForCausalLM`` fails: it has no ``lm_head.bias``).
"""

ARCH = "CosyVoice2Qwen2ForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    if ARCH not in ModelRegistry.get_supported_archs():
        # lazy "module:Class" form: vLLM imports the model only when it is used
        ModelRegistry.register_model(ARCH, "ttsrl.vllm_model:CosyVoice2Qwen2ForCausalLM")
