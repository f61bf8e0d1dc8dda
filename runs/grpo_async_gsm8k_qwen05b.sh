#!/usr/bin/env bash
# grpo_async.py (one-step off-policy rollouts, issue 20; docs/grpo_async.md) on GSM8K with Qwen2.5-Coder-0.5B-Instruct,
# one H200, vLLM rollouts: the flags of runs/grpo_gsm8k_qwen05b.sh (grpo.py's synchronous run, its comparison) with
# only the script and the run name changed, so the two curves and step times compare one to one.
#   MODEL=/path/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf DATA=/path/gsm8k OUT_DIR=runs_out \
#     bash runs/grpo_async_gsm8k_qwen05b.sh [more grpo_async.py flags, e.g. --num-steps 12 --eval-every 0]
# MODEL, DATA: as runs/grpo_gsm8k_qwen05b.sh (the GGUF's sha256 and the data layout are documented there).
# Step time: run this and runs/grpo_gsm8k_qwen05b.sh in the SAME call with the same extra flags (e.g. --num-steps 12
# --eval-every 0 --exp-name ...) and compare the median perf/step_s over steps >= 2 (docs/grpo_async.md, "Measuring").
# Learning curve: the full 100 steps with the evaluations, against the synchronous run's (docs/results/
# grpo_gsm8k_qwen05b_nofmt); across calls with --resume latest (each resume generates one step synchronously).
# --vllm.sleep-level 0 and --vllm.gpu-memory-utilization 0.25 as in the synchronous recipe: there the engine is
# resident too, and grpo_async.py never puts it to sleep (it generates while the trainer learns).
# --tis-cap 0.0 (grpo_async.py refuses it: its ratio already divides by the engine's log-probs); the engine's
# log-probs are requested at every step whatever --engine-logprobs-every says (they are pi_old).
# NOT RUN YET: no numbers exist for this recipe; the GPU path of grpo_async.py is untested.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL:?set MODEL to the assembled Qwen2.5-Coder-0.5B-Instruct .gguf}"
: "${DATA:?set DATA to the GSM8K folder (train.jsonl, test.jsonl)}"
OUT_DIR=${OUT_DIR:-runs_out}
PORT=${PORT:-29511}
PET_MASTER_PORT=$PORT torchrun --nproc_per_node=1 --master-port "$PORT" grpo_async.py --async-rollout \
  --exp-name grpo_async_gsm8k_qwen05b --out-dir "$OUT_DIR" --seed 1 \
  --model "$MODEL" --dataset "$DATA" --train-split train --eval-split test \
  --instruction "Solve the problem step by step. Give the final answer as '#### <number>' on the last line." \
  --chat-template --max-prompt-tokens 256 --max-new-tokens 512 \
  --num-steps 100 --eval-every 20 --eval-size 1319 --eval-n 0 --save-every 25 --keep-last 1 --log-samples-every 5 \
  --prompts-per-step 64 --group-size 8 --num-minibatches 2 --num-epochs 1 \
  --temperature 1.0 --top-p 1.0 --top-k 0 \
  --reward-fn math --format-coef 0 --scale-by-std --loss-agg token-mean --no-dynamic-sampling --overlong none \
  --clip-eps-low 0.2 --clip-eps-high 0.28 --kl-coef 0.0 --entropy-coef 0.0 --tis-cap 0.0 --engine-logprobs-every 10 \
  --lr 2e-6 --lr-schedule constant --warmup-steps 5 --weight-decay 0.0 --adam-betas 0.9 0.99 --max-grad-norm 1.0 \
  --max-tokens-per-microbatch 16384 --max-tokens-per-forward 0 \
  --rollout vllm --logprob-impl auto --attn-impl varlen \
  --vllm.gpu-memory-utilization 0.25 --vllm.kv-cache-fit --vllm.max-num-seqs 512 --vllm.sleep-level 0 \
  --vllm.enable-prefix-caching --vllm.dtype bfloat16 --vllm.seed-requests \
  "$@"
