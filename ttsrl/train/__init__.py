"""Training (layer 4, stages 2, 3 and 5): GRPO through verl (``grpo``, its named variants in ``algorithms``), DPO/KTO through TRL
(``dpo``, ``pairs`` for mining, ``dpo_out`` for its checkpoints), merging verl's FSDP
shards into the merged-checkpoint layout (``merge``) and choosing and trusting a step
(``steps``).

May import: ``ttsrl.reward`` (pair mining scores through the reward client), ``ttsrl.data``,
``ttsrl.model``, ``ttsrl.verl_plugin`` and the shared top-level modules. Never evaluation.
"""
