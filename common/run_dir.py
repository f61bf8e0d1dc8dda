"""The run folder: one run at a time. claim_run_dir() locks <out-dir>/<exp-name> for this process (run.lock names
the holder), refuses to start fresh over an earlier run's metrics or checkpoints unless --resume or --overwrite
is given (docs/checkpoints.md), and checks that every rank sees the folder rank 0 made (a file system all nodes
share, docs/multinode.md)."""
import atexit
import json
import os
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path

from common import dist as D
from common.checkpoint import export_dir_problem
from common.errors import UsageError


class RunDirError(UsageError, RuntimeError):
    """The run folder is held by another run, or holds an earlier run that this one would overwrite."""


LOCK = "run.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _lock_run_dir(run_dir: Path) -> str:
    """Create run_dir/run.lock naming this process (host, pid, start time); "" or an error. A lock of a dead pid on
    this host is taken over with a message; a live one, or one from another host, is refused."""
    lock = run_dir / LOCK
    me = {"host": socket.gethostname(), "pid": os.getpid(), "start": time.strftime("%Y-%m-%d %H:%M:%S"),
          "argv": sys.argv}
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                held = json.loads(lock.read_text())
            except (OSError, ValueError):
                held = {}
            if held.get("host") == me["host"] and isinstance(held.get("pid"), int) and not _pid_alive(held["pid"]):
                print(f"{lock}: taking over the stale lock of pid {held['pid']} (started {held.get('start')}), "
                      "which is no longer running", flush=True)
                lock.unlink(missing_ok=True)
                continue
            return (f"{run_dir} is in use by another run: {lock} names host {held.get('host', '?')}, pid "
                    f"{held.get('pid', '?')}, started {held.get('start', '?')}; wait for it, stop it, or pick "
                    f"another --exp-name / --out-dir (delete {lock} only if that run is gone)")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(me))
        atexit.register(_unlock, lock, os.getpid())
        return ""
    return f"{lock}: could not take the lock; remove it if no run uses {run_dir}"


def _unlock(lock: Path, pid: int) -> None:
    try:
        if json.loads(lock.read_text()).get("pid") == pid and pid == os.getpid():
            lock.unlink()
    except (OSError, ValueError):
        pass


def claim_run_dir(run_dir: Path, resume: str, overwrite: bool, export_hf: str = "") -> Path:
    """Lock the run folder for this run and refuse to start fresh over an earlier run's metrics or checkpoints
    unless --resume or --overwrite (which deletes its checkpoints) is given. A collective: rank 0 checks, every
    rank raises the same error. The lock is released when the process exits. Returns the folder. First, --export-hf
    `export_hf` is checked (common.checkpoint.export_dir_problem: not the run folder, a folder holding it, the current
    folder, the repository or a folder an export did not write), so that a long run does not end in a refused export:
    a ValueError on every rank."""
    problem = export_dir_problem(export_hf, run_dir) if export_hf and D.rank() == 0 else ""
    if problem := D.broadcast_object(problem):
        raise UsageError(problem)
    error = ""
    if D.rank() == 0:
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        error = _lock_run_dir(run_dir)
        if not error and not resume:
            metrics, ckpts = run_dir / "metrics.jsonl", run_dir / "checkpoints"
            rows = sum(1 for _ in open(metrics)) if metrics.is_file() else 0
            steps = sorted(p.name for p in ckpts.glob("*step_*")) if ckpts.is_dir() else []
            if (rows or steps) and not overwrite:
                there = ", ".join(([f"metrics.jsonl with {rows} rows"] if rows else []) +
                                  ([f"checkpoints {', '.join(steps)}"] if steps else []))
                error = (f"{run_dir} already holds a run ({there}): pass --resume latest to continue it, --overwrite "
                         "to delete it and start fresh, or another --exp-name / --out-dir")
                _unlock(run_dir / LOCK, os.getpid())
            elif overwrite and (rows or steps):
                print(f"--overwrite: deleting the earlier run's checkpoints in {run_dir} ({len(steps)} folders); "
                      "its metrics.jsonl and samples.jsonl start over", flush=True)
                shutil.rmtree(ckpts, ignore_errors=True)
    error = D.broadcast_object(error)
    if error:
        raise RunDirError(error)
    check_shared(Path(run_dir))
    return Path(run_dir)


SHARED_CHECK = ".shared-fs-check"


def check_shared(run_dir: Path, wait_s: float = 10.0) -> None:
    """Every rank must see the files rank 0 writes into `run_dir` (checkpoints are written by all ranks into one
    folder and completed by rank 0): rank 0 writes a fresh token there, every rank reads it back (for up to `wait_s`
    seconds: a network file system may show a new file late). A collective; every rank raises the same error naming
    the hosts and the path that did not see it (a node-local disk, or a different mount point)."""
    path = Path(run_dir).absolute() / SHARED_CHECK
    token = uuid.uuid4().hex if D.rank() == 0 else None
    if token:
        path.write_text(token)
    token = D.broadcast_object(token)  # also the barrier: the file exists before anyone looks
    deadline = time.monotonic() + wait_s
    while True:
        try:
            seen = "" if path.read_text() == token else "holds another token than rank 0 wrote"
        except OSError as e:
            seen = f"cannot be read ({type(e).__name__}: {e.strerror or e})"
        if not seen or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    ranks = D.all_gather_objects((socket.gethostname(), str(path), seen))  # [(host, path, "" or why not)] by rank
    if D.rank() == 0:
        path.unlink(missing_ok=True)
    blind = [f"rank {r} on {host}: {where} {why}" for r, (host, where, why) in enumerate(ranks) if why]
    if blind:
        raise RunDirError(f"not every rank sees the run folder that rank 0 (on {ranks[0][0]}) wrote: "
                          f"{'; '.join(blind)}. Put --out-dir on a file system every node mounts at the same path "
                          "(NFS, Lustre, ...): all ranks write checkpoints there (docs/multinode.md)")
