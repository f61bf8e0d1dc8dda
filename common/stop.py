"""Clean stops: SIGTERM / SIGINT ask the loop to finish its step, checkpoint and exit, on every rank at the same step.

    stop = install_stop_handler()
    for step in ...:
        ...
        if stop_agreed(stop):   # a collective: every rank, every step
            save_checkpoint(...); break
    exit_if_stopped(stop)       # last line of main: exit 143 when a signal stopped the run

`kill -USR1 <pid>` of a worker prints where each of its threads is (Python stacks, to stderr) without stopping it.

A run stopped this way exits with STOPPED_EXIT_CODE (143 = 128 + SIGTERM), so a scheduler can tell a pre-empted run
(checkpoint written: resume it) from a finished one (exit 0). docs/checkpoints.md, "Clean stops".
"""
import faulthandler
import os
import signal
import sys
import time

from common import dist as D

STOPPED_EXIT_CODE = 143  # 128 + SIGTERM: a run stopped by a signal (checkpoint written) is not a finished one
REPEAT_S = 10.0  # a SIGTERM this soon after the first is the same request, not "stop now" (see install_stop_handler)


class StopFlag:
    requested: bool = False  # a signal reached this rank
    stopped: bool = False  # stop_agreed() returned True: every rank stops after this step
    at: float = 0.0  # time.monotonic() of the first signal


def install_stop_handler() -> StopFlag:
    """SIGTERM / SIGINT set flag.requested, so the loop can finish its step, checkpoint and exit; a second signal
    stops at once. torchrun forwards SIGTERM to every worker and kills them ~30 s later: the save must fit. A SIGTERM
    within REPEAT_S of the first is the same request arriving twice (Slurm signals every process of a job step, and
    torchrun or runs/torchrun_node.sh forward it again), not a second one."""
    flag = StopFlag()

    def handler(signum, frame):
        if flag.requested and signum == signal.SIGTERM and time.monotonic() - flag.at < REPEAT_S:
            return
        if flag.requested:  # second Ctrl-C: give up on the clean stop
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        flag.requested, flag.at = True, time.monotonic()
        print(f"[rank {D.rank()}] {signal.Signals(signum).name}: stopping after this step "
              "(checkpoint, then exit); send it again to stop now", flush=True)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    # `kill -USR1 <pid>` prints every thread's Python stack to stderr and the run goes on: where a stalled step is
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    return flag


def stop_agreed(flag: StopFlag) -> bool:
    """True on every rank when any rank was asked to stop (an all-reduce max: call it on every rank, every step)."""
    flag.stopped = bool(D.all_reduce(float(flag.requested), op="max") > 0)
    return flag.stopped


def exit_if_stopped(flag: StopFlag) -> None:
    """At the very end of main: a run stopped by a signal exits with STOPPED_EXIT_CODE (143 = 128 + SIGTERM), so a
    scheduler can tell a pre-empted run (checkpoint written, resume it) from a finished one (exit 0)."""
    if flag.stopped:
        print(f"[rank {D.rank()}] exiting with code {STOPPED_EXIT_CODE} (stopped by a signal, not finished)",
              flush=True)
        sys.exit(STOPPED_EXIT_CODE)
