#!/usr/bin/env bash
# One node's launcher for a scheduler that stops a job with SIGTERM (runs/slurm_grpo.sbatch runs it on every node):
# torchrun with the arguments given. A SIGTERM or SIGINT to this script goes to the node's ranks (torchrun's child
# processes; to torchrun itself while it has none), which finish their step, checkpoint and exit 143 (the ranks count
# a signal that also reaches them from the scheduler or from torchrun once). The script waits for torchrun, which
# exits 1 after its ranks stopped however they stopped, and exits 143 when a checkpoint completed in $RUN_DIR after
# the signal (stopped cleanly: resume it with --resume latest), else torchrun's own exit code.
#   RUN_DIR=/shared/runs/grpo runs/torchrun_node.sh --nnodes 2 --nproc_per_node 8 ... grpo.py --out-dir /shared/runs
# RUN_DIR: the run folder, <out-dir>/<exp-name>. TORCHRUN: the launcher (default torchrun; split on spaces).
# Tested with two launchers on one CPU machine (tests/test_reliability_runtime.py); not yet under Slurm.
set -uo pipefail
: "${RUN_DIR:?set RUN_DIR to the run folder, <out-dir>/<exp-name>}"
stamp=$(mktemp)  # touched when the signal comes: a checkpoint's COMPLETE newer than it was written by the stop
trap 'rm -f "$stamp"' EXIT
${TORCHRUN:-torchrun} "$@" &
pid=$!
stopped=0
forward() {
  stopped=1
  touch "$stamp"
  echo "torchrun_node.sh: SIGTERM/SIGINT: asking the ranks to checkpoint and stop" >&2
  pkill -TERM -P "$pid" || kill -TERM "$pid" 2>/dev/null
}
trap forward TERM INT
while kill -0 "$pid" 2>/dev/null; do
  wait "$pid"  # returns early when a signal runs the trap; wait again until torchrun is gone
done
wait "$pid"
rc=$?
if [ "$stopped" = 1 ]; then
  done=$(find "$RUN_DIR/checkpoints" -mindepth 2 -maxdepth 2 -name COMPLETE -newer "$stamp" 2>/dev/null | sort | tail -n 1)
  if [ -n "$done" ]; then
    echo "torchrun_node.sh: stopped by a signal after checkpointing $(dirname "$done"); exit 143" >&2
    exit 143
  fi
  echo "torchrun_node.sh: stopped by a signal, but no checkpoint completed after it; torchrun exited $rc" >&2
fi
exit "$rc"
