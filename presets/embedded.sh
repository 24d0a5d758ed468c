# shellcheck shell=bash disable=SC2034
# (sourced by run.sh, which reads these variables and derives the rest from EXP_DIR: HF_MODEL_DIR,
# DATA_DIR, CKPT_DIR, MERGED_DIR, EVAL_DIR, EXPORT_PATH, ...; `bash run.sh --help` has the contract)
# Embedded CPU preset: every stage on a 2-core laptop in minutes.
# A tiny CosyVoice2-format (MODEL_FAMILY) model is pretrained (stage -1) on the shipped corpus with
# the simulated speech codec (ttsrl.embedded.codec), then GRPO-trained against the `sim` reward.
# Each value is a default, `: "${VAR:=value}"`: the environment wins (EXP_DIR=/tmp/e bash run.sh).
: "${DEVICE:=cpu}"
# MODEL_FAMILY=cosyvoice3: the same world in Fun-CosyVoice3's layout (specials in the speech
# embedding, a head without bias, every prompt opening with its <|endofprompt|> instruction)
# (run.sh's setting, default cosyvoice2: `bash run.sh --help`)
family=${MODEL_FAMILY:-cosyvoice2}
fam_tag=${family#cosyvoice2}; fam_tag=${fam_tag:+_$fam_tag}  # "" for cosyvoice2, else _FAMILY
# zero-shot, the default: every row continues a speaker prompt of the embedded world's
# pool (four simulated speakers, 16 short prompts: docs/embedded.md), the base model learns
# CosyVoice's zero-shot layout too, the reward server voices and judges each rollout with its row's
# prompt (SIM), and stage 4 scores the zero-shot test set (the same held-out texts, each with a pool
# prompt) and reports SIM. PROMPT_POOL= (empty): text-only rows in the default voice
# (EXP_DIR exp/embedded_textonly).
: "${PROMPT_POOL=data/corpus/prompt_pool}"
mode_tag=""; [[ -n $PROMPT_POOL ]] || mode_tag=_textonly
: "${EXP_DIR:=exp/embedded$fam_tag$mode_tag}"

# stage -1: the CosyVoice2 checkout to convert (built here, cached, when BUILD_BASE_MODEL=1);
# build_base_model.py's options (`python build_base_model.py --help`)
: "${BUILD_BASE_MODEL:=1}"
BASE_MODEL_ARGS=()
# zero-shot: the first quarter of the 4,000 steps text-only (reading), then 70% of the examples zero-shot
# (docs/embedded.md: reading learnt first survives the prompts)
[[ -z $PROMPT_POOL ]] || BASE_MODEL_ARGS=(--prompt-prob 0.7 --prompt-from 0.25)
: "${COSYVOICE2_DIR:=$EXP_DIR/cosyvoice2_base}"  # llm.pt + CosyVoice-BlankEN/

# stage 0
: "${TRAIN_FILE:=data/corpus/train.jsonl}"
: "${TEST_FILE:=data/corpus/test.jsonl}"
# dev set (stage 5 chooses the step on it): 64 training texts held out of GRPO by stage 0
: "${DEV_SIZE:=64}"
# the corpus's prompts: 20 tokens at most (stage 0 prints it; CosyVoice3's instruction adds 29 on the
# tiny per-character tokenizer; a pool prompt at most 3 + 6: its text and speech); verl pads every
# prompt to this
prompt_budget=32; [[ $family == cosyvoice2 ]] || prompt_budget=64
: "${MAX_PROMPT_LENGTH:=$prompt_budget}"

# stage 1
: "${REWARD_BACKEND:=sim}"
REWARD_ARGS=()
# zero-shot: measure SIM against each row's prompt, and train on CER and SIM together, the field's recipe,
# with the SIM weight measured on this world: CER 1 + SIM 0.5 (the length term multiplies the CER term).
# In 20 steps, two seeds: CER alone (REWARD_WEIGHTS=cer, the CosyVoice2 reference's reward) lost 0.05-0.08 of SIM,
# 0.2 lost 0.02-0.04, 0.5 kept it (-0.005, -0.006) removing as much of the CER (42-50%); gdpo kept it and removed
# 31% (README, "which reward"; docs/results.md)
[[ -z $PROMPT_POOL ]] || { REWARD_ARGS=(--want-sim); : "${REWARD_WEIGHTS:=0.5}"; }

# stage 2/3 (argument lists are bash arrays: a path with a space stays one argument)
# GRPO's values (batch shape, lr, steps): PRESETS["embedded"] in ttsrl/train/grpo.py
# (zero-shot: PRESETS["embedded_zeroshot"], four policy updates a step and rollouts at temperature 1.0)
grpo_preset=embedded; [[ -z $PROMPT_POOL ]] || grpo_preset=embedded_zeroshot
GRPO_ARGS=(--preset "$grpo_preset" --loggers "$LOGGERS")
# zero-shot: rollouts drawn by the rule stage 4 scores with (CosyVoice's repetition-aware redraws, at the preset's
# top-p 0.95 and top-k 25), so the policy is rewarded for what the redraws do to it: by step 20, 32-45% of the
# start's CER gone in eight runs against 34-41% with plain top-k/top-p rollouts; one of the eight lost 0.05 of SIM
# (docs/results.md). A named SAMPLING is its source's plain sampling; GRPO_EXTRA="--rollout-rule none": plain
[[ -z $PROMPT_POOL || -n ${SAMPLING:-} ]] || GRPO_ARGS+=(--rollout-rule "$family-2026")
# named variants REWARD, ALGORITHM, SAMPLING: run.sh's defaults (tanh, grpo, the preset's own sampling:
# temperature 0.8 (zero-shot 1.0), top-p 0.95, top-k 25, n 8), set them in the environment (`bash run.sh --help`)

# stage 2 with TRAINER=dpo|kto (run.sh): pair mining from the start model, then TRL
# zero-shot: 8 candidates and a 0.01 margin (docs/results.md, DPO section: chosen when the start model
# read far worse, where 4 candidates 0.05 apart were rare)
mine_k=4 mine_margin=0.05; [[ -z $PROMPT_POOL ]] || { mine_k=8; mine_margin=0.01; }
MINE_ARGS=(--k "$mine_k" --min-margin "$mine_margin" --min-token-text-ratio 0 --batch-size 32)
PREF_ARGS=(--lr 1e-4 --beta 0.1 --batch-size 16 --epochs 3 --save-steps 10)

# stage 4/5
: "${EVAL_NPROC:=2}"
# the simulated codec emits ~2 codes per text token, fewer than CosyVoice2's 25 Hz
# codec, so CosyVoice2's minimum length (2x the text tokens) is switched off; sampling
# is CosyVoice's current rule (upstream since 2026-02; ttsrl's default since 2026-12-01, commit
# 18d30af): cosyvoice2-2024 reproduces ttsrl sweeps made before 2026-12-01
# zero-shot: the test set with prompts, and the pool as the sim backend's speakers (SIM column)
eval_set=(--test-set "embedded_test=$TEST_FILE")
# (TEST_ZEROSHOT_FILE: its prompt ids are PROMPT_POOL's)
[[ -z $PROMPT_POOL ]] ||
  eval_set=(--test-set "embedded_test=${TEST_ZEROSHOT_FILE:-data/corpus/test_zeroshot.jsonl}" --prompt-dir "$PROMPT_POOL")
# dev (64 rows) decoded four times, stage 5 choosing on the mean: one draw ranked step 10 above step 20 in two of
# thirteen default runs, where the test set put step 20 well ahead (a fresh clone, one draw: dev 7.73% against
# 8.52%, test 6.90% against 5.05%; seven of eight draws of that dev set put step 20 first); ~10 s more in stage 4
EVAL_ARGS=(--backend sim "${eval_set[@]}" --min-token-text-ratio 0 --sampling-rule "$family-2026" --dev-seeds 4)
