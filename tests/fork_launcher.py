"""Launch the repository's scripts from tests without paying Python's imports for every launch: this process imports
torch, transformers and the scripts' modules once, then forks a fresh process per rank for each request.

With nproc N >= 1, each child runs its command line as `torchrun --standalone --nproc_per_node=N SCRIPT ARGS...`
runs it on a rank: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (rank 0 hosts the
gloo store on a free port), and when one rank fails the others are stopped (SIGTERM, then SIGKILL), as torchrun stops
them. With nproc 0, one child runs it as `python SCRIPT ARGS...` (or `python -m MODULE ARGS...` for an argv that
starts with "-m"). Either way: the request's environment and working folder, sys.argv and sys.path[0] as Python sets
them, __name__ == "__main__", the exit status of an uncaught error (its traceback through sys.excepthook) or of
sys.exit, non-daemon threads joined and atexit functions run at the end, and stdout and stderr each in one file (the
ranks' lines together, as torchrun's pipes).

    python tests/fork_launcher.py      # then one JSON request per line on stdin, one JSON reply per line on stdout

Request: {"argv": [SCRIPT, *ARGS], "nproc": N, "env": {...}, "cwd": DIR, "out": FILE, "err": FILE, "timeout": S};
reply: {"returncode": RC, "timed_out": BOOL}. tests/conftest.py's torchrun() and run_scripts() are the way in; tests
about the launcher itself (signals sent to torchrun, several launchers as nodes, its error report) run the real one.

Safe to fork: nothing here starts a thread, a process group or an OpenMP pool before the fork, and every child sets its
thread count from its own OMP_NUM_THREADS (OpenMP reads the variable only when the library loads). Variables that
modules read when they are imported (RL_CACHE, TORCHINDUCTOR_*) are this process's: tests/conftest.py sends a request
here only when the case leaves them as they are; a case's PYTHONPATH is put on its sys.path here, as Python would."""
import atexit
import io
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)  # this file's folder, tests/, is not on a script's path; each child sets sys.path[0] again
# the path Python builds without PYTHONPATH's entries: a child puts its own PYTHONPATH's in front, as Python would
_OWN_PATH = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
BASE_PATH = [p for p in sys.path[1:] if p not in _OWN_PATH]

import torch  # noqa: E402
import transformers  # noqa: E402,F401
import transformers.modeling_utils  # noqa: E402,F401

import dpo  # noqa: E402,F401  the scripts' modules (main() runs only as __main__)
import grpo  # noqa: E402,F401
import grpo_async  # noqa: E402,F401
import ppo  # noqa: E402,F401
import rm  # noqa: E402,F401
import sft  # noqa: E402,F401
from common.dist import _free_port  # noqa: E402

GRACE_S = 10  # after a rank failed: SIGTERM to the others, SIGKILL this long after


def run_rank(req: dict, rank: int, port: int) -> None:
    """In the forked child: become rank `rank` of the request and run its script; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # the rank and whatever it starts: one group the launcher can stop
        nproc = req["nproc"]
        os.environ.clear()
        os.environ.update(req["env"])
        if nproc:  # a rank of torchrun's
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(nproc),
                              LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.chdir(req["cwd"])
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        os.dup2(os.open(req["out"], flags), 1)
        os.dup2(os.open(req["err"], flags), 2)
        # the streams a fresh interpreter makes for files: stdout block-buffered, stderr line-buffered; PYTHONUNBUFFERED
        # (the case's, not this process's) writes both through
        raw = not os.environ.get("PYTHONUNBUFFERED")
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.open(1, "wb", closefd=False), "utf-8",
                                                       write_through=not raw)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.open(2, "wb", closefd=False), "utf-8", "backslashreplace",
                                                       line_buffering=raw, write_through=not raw)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        argv, env_path = req["argv"], [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        try:
            if argv[0] == "-m":  # as `python -m MODULE`: the current folder first on the path
                sys.argv, sys.path[:] = [argv[1], *argv[2:]], [os.getcwd(), *env_path, *BASE_PATH]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:  # as `python SCRIPT`: the script's folder first on the path
                sys.argv = list(argv)
                sys.path[:] = [str(Path(argv[0]).resolve().parent), *env_path, *BASE_PATH]
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as x:  # what the interpreter makes of sys.exit(x.code)
            code = 0 if x.code is None else x.code if isinstance(x.code, int) else 1
            if not isinstance(x.code, (int, type(None))):
                print(x.code, file=sys.stderr)
        except BaseException as x:  # noqa: BLE001 - an uncaught error: its traceback (through the script's hook), 1
            tb = x.__traceback__  # from the script's first frame on, as the interpreter prints it
            while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")):
                tb = tb.tb_next
            sys.excepthook(type(x), x.with_traceback(tb), tb)
            code = 1
        threading._shutdown()  # as the interpreter exits: wait for non-daemon threads, then the atexit functions
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - the launcher failed around the script: say so on the rank's stderr
        traceback.print_exc()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


def reap(pids: list[int], codes: dict[int, int], block: bool = False) -> None:
    """Record the exit status of each rank in `pids` that has ended (all of them with block), leaving it a zombie
    (WNOWAIT): its pid, and so its process group's id, cannot be reused before `release` has signalled the group."""
    for pid in pids:
        if pid not in codes:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG))
            if info is not None:
                codes[pid] = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def release(pids: list[int]) -> None:
    """SIGKILL what the ranks started and left behind (an engine process, a reward worker), then reap the ranks."""
    signal_groups(pids, signal.SIGKILL)
    for pid in pids:
        os.waitpid(pid, 0)


def signal_groups(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def serve(req: dict) -> dict:
    port, pids = _free_port(), []
    for rank in range(max(1, req["nproc"])):
        pid = os.fork()
        if pid == 0:
            run_rank(req, rank, port)
        try:
            os.setpgid(pid, pid)  # also in the child: whichever runs first
        except (ProcessLookupError, PermissionError):
            pass
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + req["timeout"]
    while len(codes) < len(pids) and not any(codes.values()) and time.monotonic() < deadline:
        reap(pids, codes)
        time.sleep(0.02)
    timed_out = len(codes) < len(pids) and not any(codes.values())
    if len(codes) < len(pids):  # a rank failed or time ran out: stop the others, as torchrun does
        signal_groups([p for p in pids if p not in codes], signal.SIGTERM)
        grace = time.monotonic() + GRACE_S
        while len(codes) < len(pids) and time.monotonic() < grace:
            reap(pids, codes)
            time.sleep(0.05)
        signal_groups([p for p in pids if p not in codes], signal.SIGKILL)
        reap(pids, codes, block=True)
    release(pids)
    failed = [c for c in codes.values() if c != 0]  # in the order the ranks ended: the first failure, not its echo
    return {"returncode": failed[0] if failed else 0, "timed_out": timed_out}


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # pytest's Ctrl-C: the fixture closes stdin, this process exits
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(serve(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
