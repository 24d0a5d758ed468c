"""vLLM model class for converted CosyVoice2 checkpoints (GPU only; vLLM 0.24).

Native vLLM ``Qwen2ForCausalLM`` with two changes that mirror
``modeling_cosyvoice2.CosyVoice2Qwen2ForCausalLM`` (the transformers class verl's
actor trains), so rollout and actor log-probs agree:
- ``lm_head`` is a ``ParallelLMHead`` with a bias (loaded from ``lm_head.bias``);
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
            raise ValueError("CosyVoice2 checkpoints have an untied, biased lm_head (tie_word_embeddings=false)")
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, bias=True,
                                          quant_config=vllm_config.quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))
        self.output_range = tuple(int(x) for x in config.speech_output_range)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.logits_processor(self.lm_head, hidden_states, embedding_bias=self.lm_head.bias)
        if logits is None:  # not the last pipeline rank / not the driver
            return None
        start, end = self.output_range
        ids = torch.arange(logits.shape[-1], device=logits.device)
        return logits.masked_fill((ids < start) | (ids >= end), MASKED_LOGIT)
