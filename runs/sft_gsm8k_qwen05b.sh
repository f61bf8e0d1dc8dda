#!/usr/bin/env bash
# SFT warm start on GSM8K's train answers with Qwen2.5-Coder-0.5B-Instruct, one H200, then GRPO from its export.
# Measured (2026-12-01, commit e9dafa7, 1 H200; docs/sft.md, docs/results/sft_gsm8k_qwen05b): the recipe as it is
# now, run with GRPO_STEPS=0 --save-every 0 --no-fused-loss --overwrite: starting accuracy 24.56 % with the warm
# start against 26.99 % without (1,319 test questions, grpo.py's evaluation), '####' format 0.1 % -> 94.8 %.
#  1. sft.py: GSM8K train (question, answer) pairs as (user turn with grpo.py's instruction, assistant answer);
#     40 steps of 64 conversations (2,560 of the 7,473; `--num-steps 0 --num-epochs 2` would give the 232-step,
#     2-epoch run first planned, not run), lr 1e-5 cosine after 10 warm-up steps, loss over the answer tokens only;
#     eval/loss on 256 test conversations and greedy eval/accuracy (vLLM, 512 new tokens, grpo.py's evaluation) at
#     step 0 and at the end; exported (fp32). In that run sft.py's eval/accuracy covered only the first 256 test
#     questions (--eval-size truncated them before --eval-accuracy-size applied), not 1,319.
#  2. runs/grpo_gsm8k_qwen05b.sh with --model the export: its step-0 evaluation (full test split) is the
#     warm-started starting accuracy, then GRPO_STEPS steps of GRPO (GRPO_STEPS=0: the evaluation alone, as in the
#     measured run, whose GRPO part had --format-coef 0.1, the grpo recipe's value then: no effect on an evaluation).
#   MODEL=/path/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf DATA=/path/gsm8k OUT_DIR=runs_out \
#     bash runs/sft_gsm8k_qwen05b.sh [more sft.py flags]
# MODEL and DATA as in runs/grpo_gsm8k_qwen05b.sh (DATA: a folder with train.jsonl and test.jsonl, GSM8K "main").
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL:?set MODEL to the assembled Qwen2.5-Coder-0.5B-Instruct .gguf}"
: "${DATA:?set DATA to the GSM8K folder (train.jsonl, test.jsonl)}"
OUT_DIR=${OUT_DIR:-runs_out}
PORT=${PORT:-${PET_MASTER_PORT:-29540}}  # a sweep (tools.sweep) sets PET_MASTER_PORT per slot
INSTR="Solve the problem step by step. Give the final answer as '#### <number>' on the last line."
EXPORT=$OUT_DIR/sft_gsm8k_qwen05b/policy_hf
PET_MASTER_PORT=$PORT torchrun --nproc_per_node=1 --master-port "$PORT" sft.py \
  --exp-name sft_gsm8k_qwen05b --out-dir "$OUT_DIR" --seed 1 \
  --model "$MODEL" --dataset "$DATA" --train-split train --eval-split test \
  --prompt-field question --completion-field answer --instruction "$INSTR" --assistant-mask auto --max-length 1024 \
  --num-steps 40 --sequences-per-step 64 --max-tokens-per-microbatch 16384 \
  --lr 1e-5 --lr-schedule cosine --warmup-steps 10 --weight-decay 0.0 --adam-betas 0.9 0.95 --max-grad-norm 1.0 \
  --eval-every 40 --eval-size 256 --eval-accuracy-size 1319 --max-new-tokens 512 --reward-fn math \
  --save-every 50 --keep-last 1 --rollout vllm --logprob-impl auto --attn-impl varlen \
  --vllm.gpu-memory-utilization 0.25 --vllm.kv-cache-fit --vllm.max-num-seqs 512 --vllm.sleep-level 0 \
  --vllm.dtype bfloat16 \
  --export-hf "$EXPORT" "$@"
MODEL=$EXPORT DATA=$DATA OUT_DIR=$OUT_DIR PORT=$((PORT + 1)) bash runs/grpo_gsm8k_qwen05b.sh \
  --exp-name grpo_gsm8k_qwen05b_from_sft --num-steps "${GRPO_STEPS:-100}"
