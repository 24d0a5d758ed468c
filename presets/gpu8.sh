# shellcheck shell=bash disable=SC2034
# (sourced by run.sh, which reads these variables)
# 8-GPU preset: CosyVoice2-0.5B, vLLM rollouts, CosyVoice2 token2wav + ASR reward.
# Inputs: run.sh fetches every one with a public source at the start of stage -1 (FETCH_ARGS below:
# python -m ttsrl.fetch, ttsrl/fetch/inputs.py names each source; offline it stops with one message
# saying how to place them), then checks them all via scripts/check_inputs.py and names what is missing:
#   $COSYVOICE2_DIR   released CosyVoice2-0.5B: llm.pt cosyvoice2.yaml flow.pt hift.pt campplus.onnx
#                     speech_tokenizer_v2.onnx CosyVoice-BlankEN/
#   $PROMPT_DIR       reward speaker prompts *.wav (>= 16 kHz, <= 30 s; one chosen per text)
#   $PROMPT_POOL      zero-shot training (empty: text-only rows, as the reference recipe):
#                     a folder of speaker prompt wavs, <ID>.wav, and prompt_speech_tokens.jsonl with
#                     each id's transcript and CosyVoice2 speech tokens. The reference recipe draws its
#                     prompts from aishell's test speakers; e.g. a few utterances each of aishell-1's 20
#                     test speakers, listed as "ID PATH" with a kaldi-style transcript file:
#                       .venv/bin/python scripts/prompt_tokens.py wavs.scp --texts prompt_text \
#                           --model-dir "$COSYVOICE2_DIR" --copy-wavs-to data/prompt_pool
#                     Stage 0 gives every row one prompt of it (PROMPT_SEED; docs/gpu.md), the reward
#                     server voices each rollout with its row's prompt and measures SIM against that wav:
#                     its --prompt-dir is the pool then (PROMPT_DIR is not used).
#   $ASR_MODEL_DIR    sherpa-onnx Paraformer (model[.int8].onnx + tokens.txt)
#   $TRAIN_FILE       training texts (JSONL, "text"; fetched: the reference recipe's first 80,000 lines of
#                     voxbox's aishell-3.jsonl)     $TEST_FILE  held-out texts (JSONL)
#   $CV3_ZH_DIR       CV3-Eval zero_shot zh (fetched; stage 4 adds it with EVAL_EXTRA="--test-set cv3_zh=$CV3_ZH_DIR")
#   $SEEDTTS_ZH_DIR   Seed-TTS test_zh (meta.lst + prompt wavs) and its prompt_speech_tokens.jsonl,
#                     made once with scripts/prompt_tokens.py
# CosyVoice's code comes from the pinned cosyvoice-minicpmo package (requirements.txt); set
# COSYVOICE_ROOT only to use your own CosyVoice checkout instead.
#
# Reward vs the reference recipe (CosyVoice examples/grpo/cosyvoice2/token2wav_asr_server.py):
# same formula (1 - tanh(3 x pinyin WER), TONE3 + sandhi + neutral 5), but by default
#   - the length guard is ON (rewards of implausibly long/short speech are scaled down), and
#   - numbers/text are normalised by ttsrl.text (cn2an rules, both sides) instead of
#     WeTextProcessing, the speaker is fixed per text (not random), and ASR is Paraformer
#     (the reference used SenseVoice-Small).
# Reference-exact reward text path: REWARD=tanh_reference REWARD_EXTRA=--no-length-guard
# (the reference's WeTextProcessing normaliser; speaker/ASR choices above stay ours); run.sh adds
# REWARD_EXTRA's words to REWARD_ARGS. The later NVIDIA mair-hub recipe: REWARD=exp_toneless SAMPLING=mairhub
# (exp(-12 c^1.5) of the tone-free pinyin error rate; temperature 1, top-p 1, n 8, no std division).
# Each value is a default, `: "${VAR:=value}"`: the environment wins (EXP_DIR=/data/r1 bash run.sh);
# run.sh derives the rest from EXP_DIR (HF_MODEL_DIR, DATA_DIR, CKPT_DIR, MERGED_DIR, EVAL_DIR, ...).
: "${DEVICE:=cuda}"
: "${EXP_DIR:=exp/gpu8}"

: "${COSYVOICE2_DIR:=pretrained_models/CosyVoice2-0.5B}"
: "${COSYVOICE_ROOT:=}"

: "${TRAIN_FILE:=data/aishell3_train.jsonl}"
: "${TEST_FILE:=data/corpus/test.jsonl}"
# dev set (stage 5 chooses the step on it): DEV_FILE, or 200 training texts held out by stage 0
: "${DEV_SIZE:=200}"
: "${MAX_PROMPT_LENGTH:=1024}"

: "${REWARD_BACKEND:=cosyvoice2}"
: "${ASR_MODEL_DIR:=pretrained_models/sherpa-onnx-paraformer-zh}"
# PROMPT_POOL (run.sh's setting, default empty: text-only rows): zero-shot rows from that pool (see the top)
: "${PROMPT_DIR:=data/speaker_prompts}"   # *.wav; one is chosen per text (with PROMPT_POOL: the pool instead)
# how long stage 1 waits for the server: one replica per GPU, each loading flow + HiFT, its ASR and
# its ONNX sessions on its own GPU (prompt features are extracted once and shared); a server that
# dies stops the wait at once, so the margin costs nothing when start-up fails
: "${REWARD_START_TIMEOUT_S:=900}"
: "${SEEDTTS_ZH_DIR:=data/seedtts_testset/zh}"
: "${CV3_ZH_DIR:=data/cv3_eval/zero_shot/zh}"
# argument lists are bash arrays: a path with a space stays one argument
SPEECH_ARGS=(${COSYVOICE_ROOT:+--cosyvoice-checkout "$COSYVOICE_ROOT"} --cosyvoice-model-dir "$COSYVOICE2_DIR"
  --prompt-dir "${PROMPT_POOL:-$PROMPT_DIR}" --asr sherpa --sherpa-model-dir "$ASR_MODEL_DIR" --sherpa-kind paraformer)
REWARD_ARGS=("${SPEECH_ARGS[@]}")

GRPO_ARGS=(--preset gpu8 --loggers "$LOGGERS")  # PRESETS["gpu8"] in ttsrl/train/grpo.py
# named variants REWARD, ALGORITHM, SAMPLING: run.sh's defaults (tanh, grpo, the preset's own sampling:
# the reference's temperature 0.8, top-p 0.95, top-k 25, n 4), set them in the environment (`bash run.sh --help`)

# stage 2 with TRAINER=dpo|kto: pair mining with transformers on GPU (the engine that samples by
# CosyVoice2's rule), TRL on 8 GPUs through accelerate FSDP (never run yet). The policy is loaded
# in fp32 (FSDP's master weights; bf16 masters round most 1e-6 updates away) and computes in bf16.
MINE_ARGS=(--engine hf --device cuda --k 8 --min-margin 0.1)
PREF_ARGS=(--dtype float32 --bf16-compute --lr 1e-6 --beta 0.01 --batch-size 4 --epochs 1 --save-steps 200 --gradient-checkpointing)
PREF_LAUNCH=(-m accelerate.commands.launch --num_processes 8 --use_fsdp --fsdp_sharding_strategy FULL_SHARD
  --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap Qwen2DecoderLayer
  --fsdp_state_dict_type FULL_STATE_DICT --mixed_precision bf16)

: "${EVAL_NPROC:=8}"
# CosyVoice2's own inference rule and length limits (min 2x, max 20x the text tokens).
# --batch-size: sequences one rank samples at once on the transformers engine (default 8). Memory
# per sequence is its KV cache: Qwen2-0.5B has 24 layers x 2 KV heads x 64 dims, K and V, in fp32
# (the engine's dtype) 24 KiB a token; at the longest (a 1024-token prompt with the prompt wav's
# speech tokens, plus 20x a Seed-TTS text's ~50 tokens) ~2k tokens, 48 MiB a sequence, so 64
# sequences hold ~3 GiB beside 2 GiB of fp32 weights and the rank's flow/HiFT/ASR: a few percent
# of an H200's 141 GB. A step costs about the same at 8 or 64 (reading the weights dominates), so
# 64 decodes ~8x the sequences per step; larger buys little, as a batch runs until its longest
# item stops and each of 8 ranks has ~250 of Seed-TTS zh's ~2k utterances.
EVAL_ARGS=(--backend cosyvoice2 "${SPEECH_ARGS[@]}" --test-set "seedtts_zh=$SEEDTTS_ZH_DIR"
  --sampling-rule cosyvoice2-2026 --min-token-text-ratio 2 --max-token-text-ratio 20 --batch-size 64)

CHECK_INPUTS_ARGS=(--model-dir "$COSYVOICE2_DIR" --prompt-dir "${PROMPT_POOL:-$PROMPT_DIR}" --sherpa-model-dir "$ASR_MODEL_DIR"
  --train-file "$TRAIN_FILE" --test-file "$TEST_FILE" --seedtts-dir "$SEEDTTS_ZH_DIR" ${PROMPT_POOL:+--prompt-pool "$PROMPT_POOL"}
  ${COSYVOICE_ROOT:+--cosyvoice-checkout "$COSYVOICE_ROOT"})
# stage -1 starts by fetching these (python -m ttsrl.fetch; the pool only with PROMPT_POOL set)
FETCH_ARGS=(--model-dir "$COSYVOICE2_DIR" --sherpa-model-dir "$ASR_MODEL_DIR" --train-file "$TRAIN_FILE"
  --seedtts-dir "$SEEDTTS_ZH_DIR" --cv3-dir "$CV3_ZH_DIR" --prompt-dir "$PROMPT_DIR" ${PROMPT_POOL:+--prompt-pool "$PROMPT_POOL"}
  ${COSYVOICE_ROOT:+--cosyvoice-checkout "$COSYVOICE_ROOT"})
