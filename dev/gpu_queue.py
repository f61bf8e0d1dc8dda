"""The job queue of a GPU host: each job starts as soon as the GPUs it names are free, in file order.

    setsid python3 dev/gpu_queue.py dev/queues/next.txt &      # dev/gpu_qwen.sh's `site 2` step does this

Queue file, one job per line: `NAME GPUS COMMAND...` (GPUS: `0`, `1` or `0,1`, which set CUDA_VISIBLE_DEVICES; or
lane labels such as `g` or `k`, for jobs that share the GPUs side by side: a label sets nothing, so the job sees every
GPU unless its command pins one; `#` starts a comment). The file is
read again before every launch, and every driver step copies the file from the working tree, so the queue can be
edited while it runs (reorder, add or delete lines that have not started) without touching running jobs. A job
does not overtake an earlier waiting job that needs one of its GPUs, so a 2-GPU job is not starved by later
1-GPU ones. Each job writes /tmp/logs/NAME.log (and NAME.pgid: its process group, for dev/gpu_qwen.sh stop / dump);
starts and ends (with the exit code) go to /tmp/logs/status.
`touch /tmp/logs/STOP` stops launching; the runner exits when nothing runs and nothing waits, or with
QUEUE_LINGER=SECONDS it stays that long idle (touching /tmp/logs/all.done, so the driver's `poll` returns) and starts
jobs appended meanwhile (without it, a job appended after the runner has exited never runs).
"""
import os
import subprocess
import sys
import time
from pathlib import Path

LOGS = Path(os.environ.get("QUEUE_LOGS", "/tmp/logs"))
LINGER = float(os.environ.get("QUEUE_LINGER", "0"))  # seconds to stay idle for appended jobs before exiting


def read_queue(path: Path) -> list[tuple[str, frozenset[str], str]]:
    """(name, GPUs, command) per job line; malformed lines are reported and skipped."""
    jobs = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 2)
        if len(parts) < 3:
            print(f"{path}:{n}: expected NAME GPUS COMMAND, got {line!r}", flush=True)
            continue
        jobs.append((parts[0], frozenset(parts[1].split(",")), parts[2]))
    return jobs


def runnable(jobs, started: set[str], busy: set[str]) -> list[tuple[str, frozenset[str], str]]:
    """Jobs to launch now: not started, GPUs free, and no earlier waiting job wants one of those GPUs."""
    out, claimed = [], set(busy)
    for name, gpus, cmd in jobs:
        if name in started:
            continue
        if not gpus & claimed:
            out.append((name, gpus, cmd))
        claimed |= gpus  # launched or waiting, later jobs must not take these GPUs first
    return out


def log_status(line: str) -> None:
    with open(LOGS / "status", "a") as f:
        f.write(f"{time.strftime('%H:%M:%S')} {line}\n")


def main(queue: Path) -> None:
    LOGS.mkdir(parents=True, exist_ok=True)
    running: dict[str, tuple[subprocess.Popen, frozenset[str]]] = {}
    started: set[str] = set()
    idle_since = None
    while True:
        for name, (proc, _) in list(running.items()):
            if proc.poll() is not None:
                log_status(f"end {name} rc={proc.returncode}")
                del running[name]
        jobs = read_queue(queue) if queue.exists() else []
        waiting = [j for j in jobs if j[0] not in started]
        if not (LOGS / "STOP").exists():
            busy = set().union(*(g for _, g in running.values()))
            for name, gpus, cmd in runnable(jobs, started, busy):
                log_status(f"start {name} (gpu {','.join(sorted(gpus))})")
                env = dict(os.environ)  # GPU indices pin the job; a lane label (jobs sharing one GPU) leaves it be
                if all(g.isdigit() for g in gpus):
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(sorted(gpus))
                with open(LOGS / f"{name}.log", "w") as log:
                    proc = subprocess.Popen(["bash", "-c", cmd], env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
                (LOGS / f"{name}.pgid").write_text(f"{proc.pid}\n")  # its own session: pid = process group (stop/dump)
                running[name] = (proc, gpus)
                started.add(name)
        elif not running:
            break
        if not running and not [j for j in waiting if j[0] not in started]:
            if idle_since is None:
                idle_since = time.monotonic()
                if LINGER:
                    log_status("queue idle")
                (LOGS / "all.done").touch()  # the driver's poll returns; a job appended later clears it
            if time.monotonic() - idle_since >= LINGER:
                break
        elif idle_since is not None:
            idle_since = None
            (LOGS / "all.done").unlink(missing_ok=True)
        time.sleep(1)
    log_status("queue done")
    (LOGS / "all.done").touch()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
