# shellcheck shell=bash disable=SC2034
# (sourced by run.sh, which reads these variables)
# 8-GPU preset: CosyVoice2-0.5B, vLLM rollouts, CosyVoice2 token2wav + ASR reward.
# Put the released model at $COSYVOICE2_DIR (llm.pt, flow.pt, hift.pt, CosyVoice-BlankEN/)
# and a CosyVoice checkout at $COSYVOICE_ROOT (see README, "GPU recipe").
PRESET_NAME=gpu8
DEVICE=cuda
EXP_DIR=${EXP_DIR:-exp/gpu8}

BUILD_BASE_MODEL=0
COSYVOICE2_DIR=${COSYVOICE2_DIR:-pretrained_models/CosyVoice2-0.5B}
COSYVOICE_ROOT=${COSYVOICE_ROOT:-third_party/CosyVoice}
HF_MODEL_DIR=$EXP_DIR/hf_model

TRAIN_FILE=${TRAIN_FILE:-data/emilia_zh_train.jsonl}
TEST_FILE=${TEST_FILE:-data/corpus/test.jsonl}
DATA_DIR=$EXP_DIR/data
MAX_PROMPT_LENGTH=1024

REWARD_BACKEND=cosyvoice2
REWARD_PORT=${REWARD_PORT:-8000}
ASR_MODEL_DIR=${ASR_MODEL_DIR:-pretrained_models/sherpa-onnx-paraformer-zh}
PROMPT_DIR=${PROMPT_DIR:-data/speaker_prompts}   # *.wav + .txt transcripts; one is chosen per text
# argument lists are bash arrays: a path with a space stays one argument
SPEECH_ARGS=(--cosyvoice-checkout "$COSYVOICE_ROOT" --cosyvoice-model-dir "$COSYVOICE2_DIR" --prompt-dir "$PROMPT_DIR"
  --asr sherpa --sherpa-model-dir "$ASR_MODEL_DIR" --sherpa-kind paraformer)
REWARD_ARGS=("${SPEECH_ARGS[@]}")

CKPT_DIR=$EXP_DIR/checkpoints
MERGED_DIR=$EXP_DIR/merged
LOGGERS=${LOGGERS:-console}   # console[,tensorboard][,wandb]; TensorBoard files go to $EXP_DIR/tensorboard
GRPO_ARGS=(--preset gpu --n-gpus-per-node 8 --loggers "$LOGGERS")

EVAL_DIR=$EXP_DIR/eval
EVAL_NPROC=8
EVAL_ARGS=(--backend cosyvoice2 "${SPEECH_ARGS[@]}" --test-set "seedtts_zh=${SEEDTTS_ZH_DIR:-data/seedtts_testset/zh}")
EXPORT_PATH=$EXP_DIR/llm-new.pt
