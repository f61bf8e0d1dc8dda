#!/usr/bin/env bash
# PPO (learned critic + GAE) on GSM8K with SmolLM2-135M-Instruct, one H200, vLLM rollouts, 100 steps.
# Usage: MODEL=/path/to/SmolLM2-135M-Instruct bash runs/ppo_gsm8k_smollm2.sh [extra ppo.py flags]
# 64 prompts x 1 sample per step (PPO's baseline is the critic), 4 mini-batches x 2 epochs = 8 optimiser steps
# per rollout; the critic starts from the policy checkpoint and learns alone for the first 5 steps.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL:?set MODEL to the SmolLM2-135M-Instruct folder (or .gguf)}"
torchrun --nproc_per_node=1 ppo.py \
  --exp-name ppo_gsm8k_smollm2 \
  --model "$MODEL" \
  --dataset "${DATA:?set DATA to a folder holding GSM8K train.jsonl and test.jsonl}" \
  --num-steps 100 --eval-every 20 --eval-size 200 \
  --max-prompt-tokens 256 --max-new-tokens 512 \
  --prompts-per-step 64 --samples-per-prompt 1 --num-minibatches 4 --num-epochs 2 \
  --lr 1e-6 --critic-lr 1e-5 --critic-warmup-steps 5 \
  --gamma 1.0 --lam 0.95 --kl-coef 0.05 --vf-clip 0.2 --vf-coef 0.5 \
  --format-coef 0.1 \
  --max-tokens-per-microbatch 16384 \
  --rollout vllm \
  "$@"
