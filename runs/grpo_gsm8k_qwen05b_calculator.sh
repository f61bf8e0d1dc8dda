#!/usr/bin/env bash
# GRPO on GSM8K with a calculator tool (--env calculator, docs/multiturn.md): runs/grpo_gsm8k_qwen05b.sh's model,
# data, batch (64 prompts x 8 episodes per step), loss and optimiser, so the two compare at equal samples: does
# rollout/tool_calls_mean rise, and does eval/accuracy (greedy, with the tool) beat the plain run's at step 100?
#   MODEL=/path/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf DATA=/path/gsm8k OUT_DIR=runs_out \
#     bash runs/grpo_gsm8k_qwen05b_calculator.sh [more grpo.py flags]
# The prompt explains the call format (common.environments.CALC_INSTRUCTION). Each episode: up to 4 model turns of up
# to 512 tokens, 1024 tokens after the prompt in all (tool results included); only the model's tokens are in the loss.
# Not run yet (written without a GPU): no measured result; the vLLM multi-turn path is untested on the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL:?set MODEL to the assembled Qwen2.5-Coder-0.5B-Instruct .gguf}"
: "${DATA:?set DATA to the GSM8K folder (train.jsonl, test.jsonl)}"
OUT_DIR=${OUT_DIR:-runs_out}
PORT=${PORT:-29511}
INSTRUCTION=$(python -c "from common.environments import CALC_INSTRUCTION; print(CALC_INSTRUCTION)")
PET_MASTER_PORT=$PORT torchrun --nproc_per_node=1 --master-port "$PORT" grpo.py \
  --exp-name grpo_gsm8k_qwen05b_calculator --out-dir "$OUT_DIR" --seed 1 \
  --model "$MODEL" --dataset "$DATA" --train-split train --eval-split test \
  --instruction "Solve the problem step by step. $INSTRUCTION" \
  --chat-template --max-prompt-tokens 256 --max-new-tokens 512 \
  --env calculator --max-turns 4 --max-episode-tokens 1024 \
  --num-steps 100 --eval-every 20 --eval-size 1319 --eval-n 0 --save-every 25 --keep-last 1 --log-samples-every 5 \
  --prompts-per-step 64 --group-size 8 --num-minibatches 2 --num-epochs 1 \
  --temperature 1.0 --top-p 1.0 --top-k 0 \
  --reward-fn math --format-coef 0.1 --scale-by-std --loss-agg token-mean --no-dynamic-sampling --overlong none \
  --clip-eps-low 0.2 --clip-eps-high 0.28 --kl-coef 0.0 --entropy-coef 0.0 --tis-cap 0.0 --engine-logprobs-every 10 \
  --lr 2e-6 --lr-schedule constant --warmup-steps 5 --weight-decay 0.0 --adam-betas 0.9 0.99 --max-grad-norm 1.0 \
  --max-tokens-per-microbatch 16384 --max-tokens-per-forward 0 \
  --rollout vllm --logprob-impl auto --attn-impl varlen \
  --vllm.gpu-memory-utilization 0.25 --vllm.kv-cache-fit --vllm.max-num-seqs 512 --vllm.sleep-level 0 \
  --vllm.enable-prefix-caching --vllm.dtype bfloat16 --vllm.seed-requests \
  "$@"
