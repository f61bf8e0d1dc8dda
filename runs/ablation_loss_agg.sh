#!/usr/bin/env bash
# Ablation (issue 27): GRPO's three loss aggregations x 2 seeds on GSM8K with Qwen2.5-0.5B-Instruct, vLLM rollouts.
#   MODEL=/path/to/Qwen2.5-0.5B-Instruct DATA=/path/to/gsm8k bash runs/ablation_loss_agg.sh [more grpo.py flags]
# Cells: token-mean (DAPO, the default), seq-mean-token-sum (Dr. GRPO), seq-mean-token-mean (GRPO paper), seeds 1, 2;
# run folders runs_out/ablation_loss_agg/loss_agg=<agg>,seed=<s>, one wandb group with --track. GPUS_PER_CELL=1
# (default) runs as many cells at once as there are GPUs (CUDA_VISIBLE_DEVICES or all), one after another on one.
# Rerunning the same command skips finished cells and resumes interrupted ones from their last checkpoint
# (--save-every 10), so a run cut by a time limit continues where it stopped: `timeout -s TERM 570 bash ...` makes
# the cells checkpoint before they leave (exec: the signal reaches the sweep, which waits for them). On a GPU host
# without network access (no hub) copy the model folder and GSM8K's {train,test}.jsonl there and point MODEL and
# DATA at them. Then, where matplotlib is installed:
#   python -m tools.compare runs_out/ablation_loss_agg --metrics eval/accuracy reward/mean \
#       rollout/response_len_mean --x sequences --out docs/results/ablation_loss_agg/ablation_loss_agg.png
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA=${DATA:?set DATA to a folder holding GSM8K train.jsonl and test.jsonl}
GPUS_PER_CELL=${GPUS_PER_CELL:-1}
exec python3 -m tools.sweep --name ablation_loss_agg --out-dir "${OUT:-runs_out}" --gpus-per-cell "$GPUS_PER_CELL" \
  --grid loss_agg=token-mean,seq-mean-token-sum,seq-mean-token-mean --grid seed=1,2 \
  -- torchrun --nproc_per_node="$GPUS_PER_CELL" grpo.py \
  --model "$MODEL" --dataset "$DATA" \
  --num-steps "${STEPS:-40}" --eval-every 10 --eval-size 200 --save-every 10 \
  --prompts-per-step 32 --group-size 8 --max-prompt-tokens 256 --max-new-tokens 384 \
  --lr 1e-6 --format-coef 0.1 --max-tokens-per-microbatch 32768 \
  --rollout vllm --vllm.gpu-memory-utilization 0.3 "$@"
