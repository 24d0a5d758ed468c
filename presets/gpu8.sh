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
SPEECH_ARGS="--cosyvoice-checkout $COSYVOICE_ROOT --cosyvoice-model-dir $COSYVOICE2_DIR --prompt-dir $PROMPT_DIR --asr sherpa --sherpa-model-dir $ASR_MODEL_DIR --sherpa-kind paraformer"
REWARD_ARGS="$SPEECH_ARGS"

CKPT_DIR=$EXP_DIR/checkpoints
MERGED_DIR=$EXP_DIR/merged
GRPO_ARGS="--preset gpu --n-gpus 8"

# stage 2 with TRAINER=dpo|kto: vLLM pair mining, TRL on 8 GPUs through accelerate FSDP (never run yet)
MINE_ARGS="--engine vllm --device cuda --k 8 --min-margin 0.1"
PREF_ARGS="--dtype bfloat16 --lr 1e-6 --beta 0.01 --batch-size 4 --epochs 1 --save-steps 200 --gradient-checkpointing"
PREF_LAUNCH="-m accelerate.commands.launch --num_processes 8 --use_fsdp --fsdp_sharding_strategy FULL_SHARD
  --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap Qwen2DecoderLayer
  --fsdp_state_dict_type FULL_STATE_DICT --mixed_precision bf16"

EVAL_DIR=$EXP_DIR/eval
EVAL_NPROC=8
EVAL_ARGS="--backend cosyvoice2 $SPEECH_ARGS --test-set seedtts_zh=${SEEDTTS_ZH_DIR:-data/seedtts_testset/zh}"
EXPORT_PATH=$EXP_DIR/llm-new.pt
