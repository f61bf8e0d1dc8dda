#!/usr/bin/env bash
# Runs a job queue (dev/queues/*.txt) on a GPU host that has no network access, with the Qwen2.5-Coder-0.5B GGUF as
# the real model. The host receives a copy of the working tree with each command, plus the ignored files that command
# carries, at most 64 MiB in all (the tree is ~11 MiB), and keeps /tmp between commands; so the wheel bundle and the
# model travel in pieces, one per command, and the queue runs detached while later commands poll it. Each step is one
# command, run from the copy's repository root: `QUEUE=dev/queues/X.txt bash dev/gpu_qwen.sh STEP` (default queue
# dev/queues/next.txt; later commands keep the first one's QUEUE; every command copies that file to /tmp/queue.txt,
# so edits reach the runner). When $OUT is set, it names a folder whose files come back to the caller.
# site0 carries .gpu-site/p-00 and the assets by name (.gpu-assets/{gsm8k_train,gsm8k_test}.jsonl.xz,
# qwen2.5-tokenizer.tar.xz, whl; every command copies the *.xz it has to /tmp/assets, the wheels to
# /tmp/assets/whl); `site I` carries .gpu-site/p-0I; `model II` .gpu-model/m-II. The pieces are the vLLM wheel
# bundle and the GGUF cut with `split -b 41000000` / `45000000`; dev/gpu_assets.sh makes both.
# Steps:
#   site0          snapshot the tree to /tmp/repo-snap, stage vLLM piece 0, (BENCH=1) install liger, kernel bench
#   site I         stage piece I (1, 2); after the last (2): unpack vLLM & co, GSM8K, start the queue ($QUEUE)
#   model II       stage GGUF piece II (00..10); once the staged pieces add up to the GGUF's size: join, sha256sum -c,
#                  convert once, touch /tmp/model.ok
#   poll SECONDS   wait (returns early when every job has ended), then summary + fetch into $OUT
#   stop JOB...    SIGTERM the python workers under those queue jobs (by pid), wait, summary + fetch
#   dump JOB...    SIGUSR1 those workers (common/stop.py: every thread's Python stack to the job's log), show it
#   resnap         copy the command's tree to /tmp/repo-snap2 (jobs added later `cd` there for newer code)
#   verl I         stage verl piece I (carry .gpu-assets/verl/part-0I, one per command; the assets command then
#                  carries the files of .gpu-assets by name, not the folder); after 1: unpack to /tmp/verl-site,
#                  verl's --check-config once /tmp/w05 is built, touch /tmp/verl.ok
# BENCH=1 on site0 starts the kernel bench (bench/bench_logprob.py) while the rest stages.
set -uo pipefail
export PYTHONPATH=/tmp/site:/tmp/repo-snap VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 \
  WANDB_MODE=disabled RL_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false L=/tmp/logs
S=/tmp/repo-snap LIVE=$PWD SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 GGUF_BYTES=491400064
mkdir -p $L /tmp/stage /tmp/site /tmp/runs /tmp/assets /tmp/data/gsm8k /tmp/data/hh /tmp/peers
[ -f .gpu-assets/hh_test.jsonl.gz ] && cp -n .gpu-assets/hh_test.jsonl.gz /tmp/data/hh/test.jsonl.gz
# the queue named by the first command that names one is kept for the later commands (/tmp/queue.path)
if [ -n "${QUEUE:-}" ]; then echo "$QUEUE" > /tmp/queue.path; fi
QUEUE=$(cat /tmp/queue.path 2>/dev/null || echo dev/queues/next.txt)
[ -f "$QUEUE" ] && cp "$QUEUE" /tmp/queue.txt
for f in .gpu-assets/*.xz; do [ -f "$f" ] && cp -n "$f" /tmp/assets/; done
[ -d .gpu-assets/whl ] && mkdir -p /tmp/assets/whl && cp -n .gpu-assets/whl/*.whl /tmp/assets/whl/

summary() {
  echo "== $(date +%T) status"; tail -n 30 $L/status 2>/dev/null
  python3 - <<'EOF'
import json, glob
for p in sorted(glob.glob("/tmp/runs/**/metrics.jsonl", recursive=True)):
    rows = [json.loads(l) for l in open(p) if l.strip().startswith("{")]
    ev = [(r["step"], round(100 * r["eval/accuracy"], 2)) for r in rows if "eval/accuracy" in r]
    tr = [r for r in rows if "perf/step_s" in r or "train/loss" in r]
    last = tr[-1] if tr else {}
    keys = ("step", "perf/step_s", "perf/update_s", "reward/mean", "rollout/response_len_mean",
            "train/explained_variance", "train/loss", "train/token_accuracy", "reward/rm_mean", "reward/rule_mean",
            "rollout/tool_calls_mean", "rollout/tool_errors", "rollout/logprob_gap_mean", "rollout/logprob_gap_max",
            "train/tis_weight_mean", "perf/peak_mem_gib", "eval/margin")
    print(p.split("/tmp/runs/")[1], "eval", ev, "| last", {k: round(v, 3) if isinstance(v, float) else v
                                                       for k, v in last.items() if k in keys})
EOF
  for f in $L/*.log; do echo "-- $(basename $f): $(grep -aE 'Error|error:|Traceback|passed|failed|rc=|OOM|out of memory' $f | tail -n 3 | cut -c1-300)"; done
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader; df -h /tmp | tail -1
}

fetch() {  # logs (tails) + every run's small files, one tarball into $OUT
  [ -n "${OUT:-}" ] || return 0
  rm -rf /tmp/f && mkdir -p /tmp/f
  for x in $L/*.log $L/status $L/queue.out; do [ -f $x ] && tail -c 2000000 $x > /tmp/f/$(basename $x); done
  (cd /tmp && find runs logs \( -name metrics.jsonl -o -name config.json -o -name samples.jsonl -o -name summary.json \
      -o -name 'sweep.*' -o -name 'long_*.jsonl' -o -name family_gaps.json -o -name 'profile_step*.txt' -o -name '*.md' -o -name '*.png' -o -path 'logs/*.log' \) -size -15M -print > /tmp/f.list)
  tar -czf $OUT/run.tgz -C /tmp f $(cat /tmp/f.list) 2>&1 | tail -n 2; ls -la $OUT
}

desc() { for c in $(pgrep -P $1); do echo $c; desc $c; done; }
workers() {  # the python workers (not torchrun) under queue job $1
  [ -f $L/$1.pgid ] || return 0
  for p in $(desc $(cat $L/$1.pgid)); do a=$(ps -o args= -p $p)
    case "$a" in *torchrun*|*torch.distributed.run*) ;; *python*.py*) echo $p ;; esac; done
}

case ${1:-} in
site0)
  mkdir -p $S && tar --exclude=./.gpu-site --exclude=./.gpu-model --exclude=./.gpu-assets --exclude=./.git -cf - . \
    | tar -xf - -C $S && echo "snapshot: $(find $S -type f | wc -l) files"
  cp .gpu-site/p-00 /tmp/stage/part-00
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader; nproc; free -g | head -2
  df -h /tmp $PWD | tail -2
  cat > /tmp/bench.sh <<EOF
cd $S; export PYTHONPATH=/tmp/peers:$S
python3 -m pip install -q --no-index --no-deps --target /tmp/peers /tmp/assets/whl/*.whl
echo "\$(date +%T) start kernel-bench" >> $L/status
python3 bench/bench_logprob.py --variants loss --budgets-mb 2048 --loss-sub 512 --skip naive --profile --repeat 5 > $L/kernel-bench.log 2>&1
echo "\$(date +%T) end kernel-bench rc=\$?" >> $L/status
touch /tmp/bench.done
EOF
  if [ "${BENCH:-0}" = 1 ]; then (unset OUT; setsid bash /tmp/bench.sh < /dev/null > /dev/null 2>&1 &)
  else touch /tmp/bench.done; fi
  ;;
site)
  for i in $(seq 0 $(($2 - 1))); do  # a host replaced between commands has lost the earlier pieces
    [ -f /tmp/stage/part-0$i ] || { echo "BARE MACHINE: part-0$i is not staged here (the host changed between commands): start again at site0"; exit 3; }
  done
  cp .gpu-site/p-0$2 /tmp/stage/part-0$2 && ls /tmp/stage
  [ "$2" = 2 ] || exit 0
  cat /tmp/stage/part-0[012] | tar -xJ -C /tmp/site && rm -f /tmp/stage/part-*
  for s in train test; do xz -dc /tmp/assets/gsm8k_$s.jsonl.xz > /tmp/data/gsm8k/$s.jsonl; done; wc -l /tmp/data/gsm8k/*
  python3 -c "import vllm, tyro, datasets, math_verify; print('vllm', vllm.__version__)"
  cd $S && (unset OUT; QUEUE_LINGER=1800 setsid python3 dev/gpu_queue.py /tmp/queue.txt > $L/queue.out 2>&1 < /dev/null &)
  sleep 2; summary
  ;;
model)
  cp .gpu-model/m-$2 /tmp/stage/ && ls /tmp/stage
  if [ "$(cat /tmp/stage/m-* | wc -c)" = $GGUF_BYTES ]; then  # every piece is here (m-00 .. in name order)
    cat /tmp/stage/m-* > /tmp/qwen.gguf && echo "$SHA  /tmp/qwen.gguf" | sha256sum -c && rm -f /tmp/stage/m-* \
      && cd $S && python3 -c "from common.models import resolve_model as r; print(r('/tmp/qwen.gguf'))" \
      && touch /tmp/model.ok && echo MODEL OK
  fi
  summary
  ;;
poll)
  end=$((SECONDS + $2))
  busy() { [ ! -f $L/all.done ] || [ ! -f /tmp/bench.done ]; }
  while [ $SECONDS -lt $end ] && busy; do sleep 5; done
  summary; fetch
  ;;
stop)  # stop JOB...: SIGTERM the python worker(s) under the job (not torchrun: it SIGKILLs after 30 s), by pid
  shift; fetch
  for job in "$@"; do w=$(workers $job)
    for p in $w; do echo "SIGTERM $job $p: $(ps -o args= -p $p | cut -c1-100)"; kill -TERM $p; done
    # no python worker found (or no .pgid): the job's whole process group (gpu_queue.py starts each in its own)
    [ -z "$w" ] && [ -f $L/$job.pgid ] && echo "SIGTERM $job's group $(cat $L/$job.pgid)" && kill -TERM -- -$(cat $L/$job.pgid)
  done
  end=$((SECONDS + ${STOP_WAIT:-45}))
  while [ $SECONDS -lt $end ] && [ "$(grep -c ' start ' $L/status)" -gt "$(grep -c ' end ' $L/status)" ]; do sleep 3; done
  summary; fetch
  ;;
dump)
  shift; for job in "$@"; do for p in $(workers $job); do kill -USR1 $p && echo "SIGUSR1 $job $p"; done; done
  sleep 3; for job in "$@"; do echo "== $job"; tail -n 60 $L/$job.log | cut -c1-200; done
  summary
  ;;
verl)
  mkdir -p /tmp/stage-verl && cp .gpu-assets/verl/part-0$2 /tmp/stage-verl/ && ls -la /tmp/stage-verl
  if [ "$2" = 1 ]; then
    mkdir -p /tmp/verl-site && cat /tmp/stage-verl/part-* | tar -xJ -C /tmp/verl-site && rm -rf /tmp/stage-verl
    (cd $S && unset OUT && setsid bash -c 'until [ -f /tmp/w05/prompts.jsonl ]; do sleep 2; done; timeout 300 python3 \
      bench/verl_w05.py --model /tmp/w05/model-0.5b --prompts /tmp/w05/prompts.jsonl --check-config \
      --site /tmp/verl-site > /tmp/logs/verl-check.log 2>&1 && touch /tmp/verl.ok; touch /tmp/verl.checked' \
      < /dev/null > /dev/null 2>&1 &)
  fi
  summary
  ;;
resnap)
  rm -rf /tmp/repo-snap2 && mkdir -p /tmp/repo-snap2 && tar --exclude=./.gpu-site --exclude=./.gpu-model \
    --exclude=./.gpu-assets --exclude=./.git -cf - . | tar -xf - -C /tmp/repo-snap2 && echo "snap2: $(find /tmp/repo-snap2 -type f | wc -l) files"
  summary
  ;;
*) echo "usage: $0 site0|site I|model I|verl I|poll SECONDS|stop JOB...|dump JOB...|resnap"; exit 2 ;;
esac
