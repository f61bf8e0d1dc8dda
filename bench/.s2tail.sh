#!/usr/bin/env bash
# session 2: the rest of GPU 1's queue after w05-ckpt, reordered to fit the device budget (W7B-2 before TP=2)
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled RL_CACHE=/tmp/cache \
  PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
L=/tmp/logs; A=$PWD/.gpu-assets
W05="python3 bench/w05.py --tokenizer-tar $A/qwen2.5-tokenizer.tar.xz --gsm8k /tmp/data/gsm8k/train.jsonl --work-dir /tmp/w05"
job() { local name=$1 gpus=$2; shift 2; echo "$(date +%T) start $name (gpu $gpus)" >> $L/status
  CUDA_VISIBLE_DEVICES=$gpus bash -c "$*" > $L/$name.log 2>&1; echo "$(date +%T) end $name rc=$?" >> $L/status; }
while ! grep -q "end w05-ckpt" $L/status; do sleep 2; done
job w05-offload 1 "OUT=$L/w05-offload $W05 --nproc 1 --num-steps 3 --only grpo --grpo-extra=--fsdp.cpu-offload"
while [ ! -f $L/gpu0.done ]; do sleep 2; done
job w05-2gpu 0,1 "OUT=$L/w05-2 $W05 --nproc 2 --num-steps 3 --only grpo"
job w7b-2 0,1 "OUT=$L/w7b bash bench/w7b.sh --tokenizer-tar $A/qwen2.5-tokenizer.tar.xz --gsm8k /tmp/data/gsm8k/train.jsonl --work-dir /tmp/w05 --only grpo --num-steps 3"
job w05-2gpu-tp2 0,1 "OUT=$L/w05-2tp $W05 --nproc 2 --num-steps 3 --only grpo --grpo-extra='--vllm.tensor-parallel-size 2'"
touch $L/all.done
