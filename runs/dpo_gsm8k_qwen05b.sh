#!/usr/bin/env bash
# DPO on the policy's own GSM8K samples, Qwen2.5-Coder-0.5B-Instruct, one H200. Three stages:
#  1. make-pairs: 8 samples (temperature 1, 512 new tokens) for each of the first 1,024 GSM8K train questions,
#     scored with the math reward; one (correct, wrong) pair per question that has both.
#  2. dpo.py on those pairs (10 % held out, seeded): sigmoid loss, beta 0.1, lr 2e-6 cosine, 2 epochs of 32 pairs;
#     held-out preference accuracy at the start, every 5 steps and at the end; the policy exported as an HF folder.
#  3. greedy pass@1 of the exported policy on the FULL GSM8K test split (1,319), through grpo.py with --num-steps 0
#     (evaluation only; same instruction, template and 512 new tokens as the GRPO run's step-0 evaluation).
#   MODEL=/path/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf DATA=/path/gsm8k OUT_DIR=runs_out bash runs/dpo_gsm8k_qwen05b.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL:?set MODEL to the assembled Qwen2.5-Coder-0.5B-Instruct .gguf}"
: "${DATA:?set DATA to the GSM8K folder (train.jsonl, test.jsonl)}"
OUT_DIR=${OUT_DIR:-runs_out}
PORT=${PORT:-${PET_MASTER_PORT:-29530}}  # a sweep (tools.sweep) sets PET_MASTER_PORT per slot
NUM_PROMPTS=${NUM_PROMPTS:-1024}
INSTR="Solve the problem step by step. Give the final answer as '#### <number>' on the last line."
mkdir -p "$OUT_DIR/dpo_gsm8k_qwen05b"
PAIRS=$OUT_DIR/dpo_gsm8k_qwen05b/pairs.jsonl
PET_MASTER_PORT=$PORT torchrun --nproc_per_node=1 --master-port "$PORT" -m tools.make_pairs \
  --out "$PAIRS" --model "$MODEL" --dataset "$DATA" --split train --instruction "$INSTR" \
  --num-prompts "$NUM_PROMPTS" --samples 8 --pairs-per-prompt 1 --temperature 1.0 --max-new-tokens 512 \
  --reward-fn math --rollout vllm --seed 1
PET_MASTER_PORT=$((PORT + 1)) torchrun --nproc_per_node=1 --master-port $((PORT + 1)) dpo.py \
  --exp-name dpo_gsm8k_qwen05b --out-dir "$OUT_DIR" --seed 1 \
  --model "$MODEL" --dataset "$PAIRS" --train-split train --eval-fraction 0.1 \
  --prompt-field prompt --chosen-field chosen --rejected-field rejected --max-length 1024 \
  --loss sigmoid --beta 0.1 --label-smoothing 0.0 --lr 2e-6 --lr-schedule cosine --warmup-steps 3 \
  --weight-decay 0.0 --adam-betas 0.9 0.99 --max-grad-norm 1.0 \
  --pairs-per-step 32 --num-epochs 2 --num-steps 0 --eval-every 5 --eval-size 0 \
  --max-tokens-per-microbatch 16384 --ref-cache --cache-dir "$OUT_DIR/dpo_gsm8k_qwen05b/ref_logp" \
  --export-hf "$OUT_DIR/dpo_gsm8k_qwen05b/policy_hf" "$@"
PET_MASTER_PORT=$((PORT + 2)) torchrun --nproc_per_node=1 --master-port $((PORT + 2)) grpo.py \
  --exp-name dpo_gsm8k_qwen05b_eval --out-dir "$OUT_DIR" --seed 1 \
  --model "$OUT_DIR/dpo_gsm8k_qwen05b/policy_hf" --dataset "$DATA" --train-split train --eval-split test \
  --instruction "$INSTR" --chat-template --max-prompt-tokens 256 --max-new-tokens 512 \
  --num-steps 0 --eval-every 1 --eval-size 1319 --eval-n 0 --rollout vllm \
  --vllm.gpu-memory-utilization 0.2 --vllm.kv-cache-fit --vllm.max-num-seqs 512 --vllm.dtype bfloat16
