# shellcheck shell=bash disable=SC2034
# (sourced by run.sh, which reads these variables)
# 8-GPU preset for Fun-CosyVoice3-0.5B-2512: presets/gpu8.sh (its GRPO, DPO/KTO and stage-4 settings,
# read it first) with CosyVoice3's model folder, token2wav and sampling rule (docs/families.md).
#   PRESET=presets/gpu8_cosyvoice3.sh COSYVOICE_ROOT=/path/to/CosyVoice bash run.sh -1 5
# Inputs (run.sh fetches those with a public source at the start of stage -1, as gpu8.sh; then
# checks them all via scripts/check_inputs.py):
#   $COSYVOICE2_DIR   the released Fun-CosyVoice3-0.5B-2512 folder (the setting keeps its historical
#                     name): llm.pt (and llm.rl.pt: LLM_FILE=llm.rl.pt goes on from upstream's RL
#                     checkpoint) cosyvoice3.yaml flow.pt hift.pt campplus.onnx speech_tokenizer_v3.onnx
#                     CosyVoice-BlankEN/
#   $COSYVOICE_ROOT   a CosyVoice source checkout at or after dd2d926 (2025-08-20): the token2wav code of
#                     CosyVoice3 (DiT flow, causal HiFT) is not in the PyPI package gpu8.sh uses
#   $SEEDTTS_ZH_DIR   Seed-TTS test_zh with prompt_speech_tokens.jsonl made by CosyVoice3's own speech
#                     tokenizer: python scripts/prompt_tokens.py --model-dir "$COSYVOICE2_DIR" \
#                       --cosyvoice-checkout "$COSYVOICE_ROOT" data/seedtts_testset/zh
#   $PROMPT_DIR, $ASR_MODEL_DIR, $TRAIN_FILE, $TEST_FILE   as in gpu8.sh
#   $PROMPT_POOL      zero-shot training, as in gpu8.sh, its speech tokens made by CosyVoice3's own
#                     tokenizer (scripts/prompt_tokens.py --model-dir "$COSYVOICE2_DIR" --cosyvoice-checkout ...)
# Each value is a default, `: "${VAR:=value}"`: the environment wins.
: "${MODEL_FAMILY:=cosyvoice3}"
: "${EXP_DIR:=exp/gpu8_cosyvoice3}"
: "${COSYVOICE2_DIR:=pretrained_models/Fun-CosyVoice3-0.5B-2512}"
: "${COSYVOICE_ROOT:=third_party/CosyVoice}"
: "${REWARD_BACKEND:=cosyvoice3}"
# shellcheck source=presets/gpu8.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu8.sh"

# gpu8.sh's lists, with CosyVoice3's backend and checkout and its sampling rule (every stop row held
# before the minimum length: docs/families.md); lengths as upstream's CosyVoice3 (2x..20x)
EVAL_ARGS=(--backend cosyvoice3 "${SPEECH_ARGS[@]}" --test-set "seedtts_zh=$SEEDTTS_ZH_DIR"
  --sampling-rule cosyvoice3-2026 --min-token-text-ratio 2 --max-token-text-ratio 20 --batch-size 64)
CHECK_INPUTS_ARGS+=(--backend cosyvoice3)
FETCH_ARGS+=(--backend cosyvoice3)  # its release, llm.rl.pt included; prompt tokens by speech_tokenizer_v3
