#!/usr/bin/env bash
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled RL_CACHE=/tmp/cache \
  PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
L=/tmp/logs; A=$PWD/.gpu-assets
while pgrep -f "bench/w05.p[y]" > /dev/null; do sleep 2; done
echo "$(date +%T) start w05-2gpu-tp2 (gpu 0,1)" >> $L/status
CUDA_VISIBLE_DEVICES=0,1 OUT=$L/w05-2tp python3 bench/w05.py --tokenizer-tar $A/qwen2.5-tokenizer.tar.xz --gsm8k /tmp/data/gsm8k/train.jsonl --work-dir /tmp/w05 --nproc 2 --num-steps 3 --only grpo "--grpo-extra=--vllm.tensor-parallel-size 2" > $L/w05-2gpu-tp2.log 2>&1
echo "$(date +%T) end w05-2gpu-tp2 rc=$?" >> $L/status
