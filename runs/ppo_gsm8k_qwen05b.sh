#!/usr/bin/env bash
# PPO (learned critic + GAE) on GSM8K with Qwen2.5-Coder-0.5B-Instruct, one H200, vLLM rollouts, with the same
# number of sampled sequences per step as runs/grpo_gsm8k_qwen05b.sh (512), here 512 prompts x 1 sample (the critic
# is the baseline). Full test split (1,319, greedy) at step 0, every 20 steps and at the end.
#   MODEL=/path/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf DATA=/path/gsm8k OUT_DIR=runs_out \
#     bash runs/ppo_gsm8k_qwen05b.sh [more ppo.py flags]
# 4 mini-batches x 1 epoch = 4 optimiser steps per rollout; actor lr 2e-6, critic lr 1e-5 (critic starts from the
# policy's weights and learns alone for 3 steps); gamma = lambda = 1 (Monte-Carlo returns minus V, as verl's GSM8K
# recipe); no KL penalty (no reference model); clip 0.2 / 0.28; reward as GRPO's (correct + 0.1 x format).
# --vllm.sleep-level 0 (engine resident): with other jobs on the same GPU vLLM's sleep asserts on device-wide memory
# (grpo recipe). Measured (2026-12-01, commit e9dafa7, 1 H200, beside GRPO until step 51): 26.99 % -> 37.91 % at
# step 60, stopped by SIGTERM after step 77 (the host's time ran out); docs/ppo.md, docs/results/ppo_gsm8k_qwen05b.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL:?set MODEL to the assembled Qwen2.5-Coder-0.5B-Instruct .gguf}"
: "${DATA:?set DATA to the GSM8K folder (train.jsonl, test.jsonl)}"
OUT_DIR=${OUT_DIR:-runs_out}
PORT=${PORT:-${PET_MASTER_PORT:-29520}}  # a sweep (tools.sweep) sets PET_MASTER_PORT per slot
PET_MASTER_PORT=$PORT torchrun --nproc_per_node=1 --master-port "$PORT" ppo.py \
  --exp-name ppo_gsm8k_qwen05b --out-dir "$OUT_DIR" --seed 1 \
  --model "$MODEL" --dataset "$DATA" --train-split train --eval-split test \
  --instruction "Solve the problem step by step. Give the final answer as '#### <number>' on the last line." \
  --chat-template --max-prompt-tokens 256 --max-new-tokens 512 \
  --num-steps 100 --eval-every 20 --eval-size 1319 --eval-n 0 --save-every 50 --keep-last 1 --log-samples-every 5 \
  --prompts-per-step 512 --samples-per-prompt 1 --num-minibatches 4 --num-epochs 1 \
  --temperature 1.0 --top-p 1.0 --top-k 0 \
  --reward-fn math --format-coef 0.1 --loss-agg token-mean \
  --gamma 1.0 --lam 1.0 --no-bootstrap-truncated --whiten-adv \
  --clip-eps-low 0.2 --clip-eps-high 0.28 --vf-clip 0.2 --vf-coef 0.5 \
  --kl-coef 0.0 --kl-target 0.0 --entropy-coef 0.0 --tis-cap 0.0 --engine-logprobs-every 10 \
  --lr 2e-6 --critic-lr 1e-5 --critic-warmup-steps 3 --lr-schedule constant --warmup-steps 5 \
  --weight-decay 0.0 --adam-betas 0.9 0.99 --max-grad-norm 1.0 \
  --max-tokens-per-microbatch 16384 --max-tokens-per-forward 0 \
  --rollout vllm --logprob-impl auto --attn-impl varlen \
  --vllm.gpu-memory-utilization 0.2 --vllm.kv-cache-fit --vllm.max-num-seqs 512 --vllm.sleep-level 0 \
  --vllm.enable-prefix-caching --vllm.dtype bfloat16 --vllm.seed-requests \
  "$@"
