"""ttsrl: GRPO post-training for speech-token LLM text-to-speech (CosyVoice2 first).

The top-level scripts of the repository are thin CLIs over this package. Its layers, each
importing only from layers below it (``tests/test_layers.py`` checks this):

0. shared modules here: ``atomic`` (every writer's crash-safe policy), ``cli`` (options
   declared by dataclass fields), ``console``, ``jsonl`` (the one JSONL reader),
   ``knobs`` (every ``TTSRL_*`` environment variable), ``text`` (normaliser, pinyin, error
   counts), ``limits``, ``stats``, ``lifeline`` (children that die with their parent)
1. ``families`` - one folder per model family (its layout, rules, token2wav) and their registry;
   ``model``    - the speech LM: token ids, conversion, HF/vLLM classes, generation
2. ``embedded`` - the CPU preset's simulated codec and tiny model;
   ``data``     - stage 0, test sets, the dev split;
   ``verl_plugin`` - our verl plugin (CPU platform, hf rollout); its rollout draws by the model's
                  sampling rule, so it sits above ``model``
3. ``reward``   - the reward service, its backends, protocol and client (stage 1)
   ``fetch``    - the GPU recipe's inputs from their public homes, laid out and recorded (stage -1)
4. ``train``    - GRPO, DPO/KTO, merging, step choice (stages 2, 3, 5)
5. ``eval``     - the CER sweep and its report (stage 4)
6. ``launch``   - under run.sh: settings, reward servers, stage 2 runner, node roles
"""
