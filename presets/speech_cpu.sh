# shellcheck shell=bash disable=SC2034
# (sourced by run.sh, which reads these variables and derives the rest from EXP_DIR: `bash run.sh --help`)
# Real speech on a 2-core laptop: PRESET=presets/speech_cpu.sh bash run.sh (about 32 min, docs/speech.md).
# A tiny LM of the kokoro family (ttsrl/families/kokoro/) is pretrained (stage -1) to read the corpus as
# Kokoro's phonemes, misaki's Mandarin G2P its teacher, then GRPO-trained against the `kokoro` reward:
# Kokoro-82M speaks each rollout in its row's voice (or the voice its first voice token names),
# Whisper-base transcribes it (CER), Resemblyzer compares it with the row's voice (SIM). Stage 4 adds
# DNSMOS and writes the listening page. Every model ships in a registry package (no hub).
# Each value is a default, `: "${VAR:=value}"`: the environment wins (EXP_DIR=/tmp/s bash run.sh).
: "${DEVICE:=cpu}"
: "${MODEL_FAMILY:=kokoro}"  # the preset is this family's (its data, backend and rule)
: "${EXP_DIR:=exp/speech_cpu}"
# zero-shot: every row continues one of the five voices' prompts (a short phrase and its phonemes, led by
# the voice's token): data/kokoro/, made by scripts/kokoro_data.py
: "${PROMPT_POOL=data/kokoro/prompt_pool}"

# stage -1: build_base_model.py's options (`python build_base_model.py --help`): the first quarter of the
# steps text-only (reading), then 70% of the examples zero-shot; in 20% of the teacher's characters the
# reading of the character's one confusable character; in 15% of the zero-shot targets another voice's
# token (ttsrl/embedded/phoneme_lm.py)
: "${BUILD_BASE_MODEL:=1}"
BASE_MODEL_ARGS=(--steps 3000 --prompt-prob 0.7 --prompt-from 0.25 --syllable-noise 0.2 --speaker-leak 0.15)
: "${COSYVOICE2_DIR:=$EXP_DIR/kokoro_base}"  # llm.pt + CosyVoice-BlankEN/

# stage 0: the corpus without its 22 training sentences with Latin letters (the G2P cannot read them)
: "${TRAIN_FILE:=data/kokoro/train.jsonl}"
: "${TEST_FILE:=data/kokoro/test_zeroshot.jsonl}"
: "${DEV_SIZE:=32}"
# a row: at most 20 text tokens, a prompt of 3 characters and 14 codes, sos and task_id
: "${MAX_PROMPT_LENGTH:=48}"

# stage 1: reward cer_nll, the harmonic mean of 1 - CER and Whisper's confidence in the reference text (its
# mean token probability given the audio, teacher-forced): a wrong syllable lowers it even where Whisper's
# language model writes the right sentence anyway, so groups of 4 rollouts differ where CER alone ties them
# (16 steps, 120 test sentences: CER -7.9 points [-16.9, +0.2] with it, -3.5 [-11.9, +3.8] with REWARD=tanh);
# SIM (Resemblyzer, against the row's voice) weighted 0.1 as GLM-TTS does (REWARD_WEIGHTS=cer: CER alone,
# which lets the voice drift to the one Whisper reads best)
: "${REWARD:=cer_nll}"
: "${REWARD_BACKEND:=kokoro}"
# Whisper encodes only the seconds a batch needs, not its 30 s window: 1.7x the rollouts a second, CER
# +1.3 points [-2.4, +5.6] against the full window (benchmarks/bench_speech_reward.py; docs/speech.md)
REWARD_ARGS=(--want-sim --whisper-fit-window)
: "${REWARD_WEIGHTS:=glm_tts}"

# stage 2/3: PRESETS["speech_cpu"] in ttsrl/train/grpo.py
GRPO_ARGS=(--preset speech_cpu --loggers "$LOGGERS")

# stage 4/5: one rank (the backend takes both cores: Kokoro one utterance a core); the 120 held-out
# sentences of data/kokoro/test_zeroshot.jsonl, each in its row's voice; sampling by the family's rule with
# --tau-r 1.0 (repetition-aware redraws only for a symbol filling the whole window: phonemes repeat within
# ten symbols all the time, ttsrl/families/kokoro/); Whisper's fitted window, as the reward's
: "${EVAL_NPROC:=1}"
EVAL_ARGS=(--backend kokoro --whisper-fit-window --test-set "speech_test=data/kokoro/test_zeroshot.jsonl"
  --min-token-text-ratio 0 --sampling-rule kokoro-2026 --tau-r 1.0)
