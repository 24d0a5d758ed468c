"""vLLM model class for converted CosyVoice checkpoints of every family (GPU only; vLLM 0.24).

Native vLLM ``Qwen2ForCausalLM`` with two changes that mirror
``modeling_cosyvoice2.CosyVoice2Qwen2ForCausalLM`` (the transformers class verl's
actor trains), so rollout and actor log-probs agree:
- ``lm_head`` is a ``ParallelLMHead`` with a bias (loaded from ``lm_head.bias``) when
  ``config.speech_head_bias`` (absent: true; CosyVoice3: false, no bias);
- logits outside ``config.speech_output_range`` are set to ``MASKED_LOGIT``.
"""

import torch
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.utils import maybe_prefix

from ttsrl.model.modeling_cosyvoice2 import MASKED_LOGIT


class CosyVoice2Qwen2ForCausalLM(Qwen2ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = self.config
        if config.tie_word_embeddings:
            raise ValueError("CosyVoice checkpoints have an untied lm_head (tie_word_embeddings=false)")
        self.head_bias = bool(getattr(config, "speech_head_bias", True))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, bias=self.head_bias,
                                          quant_config=vllm_config.quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))
        self.output_range = tuple(int(x) for x in config.speech_output_range)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.logits_processor(self.lm_head, hidden_states,
                                       embedding_bias=self.lm_head.bias if self.head_bias else None)
        if logits is None:  # not the last pipeline rank / not the driver
            return None
        start, end = self.output_range
        ids = torch.arange(logits.shape[-1], device=logits.device)
        return logits.masked_fill((ids < start) | (ids >= end), MASKED_LOGIT)
