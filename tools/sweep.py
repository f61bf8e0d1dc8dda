"""Run a grid of configurations of one training script: one run folder per cell, one wandb group, resumable.

    python -m tools.sweep --name loss_agg --grid loss_agg=token-mean,seq-mean-token-mean --grid seed=1,2 \\
        -- torchrun --standalone --nproc_per_node=1 grpo.py --num-steps 50 --track
    python -m tools.sweep --cmd "python grpo.py --num-steps 3" --grid seed=1,2,3               # CPU, one at a time
    python -m tools.sweep --gpus 0,1,2,3 --gpus-per-cell 2 --grid seed=1,2,3 -- torchrun --nproc_per_node=2 grpo.py

Each cell adds `--<key> <value>` per grid key (loss_agg and loss-agg both give --loss-agg; true/false give
--key / --no-key) and `--out-dir <out-dir>/<name> --exp-name <cell>`, so its run folder is
<out-dir>/<name>/<cell>, the cell named `key=value,key=value`. Its stdout and stderr go to <run folder>/sweep.log.
wandb (with --track in the command): WANDB_RUN_GROUP=<name> and WANDB_TAGS=the cell's key=value pairs are set,
which wandb.init reads itself; the cell's values are in the run's config as the flags they are.
A cell is complete when its run folder holds the final checkpoint (checkpoints/step_<N>/COMPLETE, N from
config.json) and metrics.jsonl holds the final step (N with evaluation on, else N - 1); complete cells are skipped,
a cell with a complete checkpoint is resumed with --resume latest, any other one starts over. A failed cell is
reported at the end without stopping the others; the exit status is 1 when any cell failed. <out-dir>/<name>/
sweep.json records the base command, the grid and each cell's command, status, exit code and log. docs/sweeps.md.
"""
import argparse
import itertools
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

LOG = "sweep.log"


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """['loss_agg=a,b', 'seed=1,2'] -> {'loss_agg': ['a', 'b'], 'seed': ['1', '2']} (keys with underscores)."""
    grid = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        vals = [v.strip() for v in values.split(",")]
        if not sep or not key or not all(vals):
            raise SystemExit(f"--grid {item!r}: write KEY=V1,V2,... (e.g. --grid seed=1,2,3), no empty values")
        if key in grid:
            raise SystemExit(f"--grid {key} is given twice: put all its values in one --grid {key}=V1,V2")
        if len(set(vals)) < len(vals):
            raise SystemExit(f"--grid {item!r}: a value is repeated")
        grid[key] = vals
    if not grid:
        raise SystemExit("give at least one --grid KEY=V1,V2,...")
    return grid


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def cell_args(values: dict[str, str]) -> list[str]:
    """The flags a cell adds to the base command; booleans follow tyro's --flag / --no-flag."""
    out = []
    for key, v in values.items():
        if v.lower() in ("true", "false"):
            *parent, leaf = key.rsplit(".", 1)
            out.append(flag(key) if v.lower() == "true" else flag(".".join(parent + ["no_" + leaf])))
        else:
            out += [flag(key), v]
    return out


def cell_name(values: dict[str, str]) -> str:
    return ",".join(f"{k}={re.sub(r'[^A-Za-z0-9._+-]', '-', v)}" for k, v in values.items())


def cells_of(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    """The grid's cells, the first key varying slowest."""
    cells = [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]
    names = [cell_name(c) for c in cells]
    if len(set(names)) < len(names):
        raise SystemExit("two cells get the same folder name (values differ only in characters other than "
                         "letters, digits and ._+-); change the values")
    return cells


def check_base(base: list[str], grid: dict, parallel: bool) -> None:
    """Refuse a base command that sets what the sweep sets per cell."""
    given = {t.split("=", 1)[0].lstrip("-").replace("-", "_") for t in base if t.startswith("--")}
    for key in ("out_dir", "exp_name", "resume"):
        if key in given:
            raise SystemExit(f"the base command sets {flag(key)}, which the sweep sets per cell: remove it (the run "
                             f"folder is <--out-dir>/<--name>/<cell>; interrupted cells resume by themselves)")
    for key in grid:
        if key in given or "no_" + key.rsplit(".", 1)[-1] in given:
            raise SystemExit(f"--grid {key}: the base command also sets {flag(key)}; remove it from the command")
    if parallel and given & {"master_port", "rdzv_endpoint"}:
        raise SystemExit("cells run at the same time need distinct torchrun ports: remove --master-port / "
                         "--rdzv-endpoint from the command (the sweep sets PET_MASTER_PORT per slot)")


def _last_step(metrics: Path) -> int:
    last = -1
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                last = max(last, int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                pass  # a line cut by a kill
    return last


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints (folders step_NNNNNN with the COMPLETE marker; common/checkpoint.py)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in root.iterdir()
                  if re.fullmatch(r"step_\d+", p.name) and (p / "COMPLETE").is_file())


def cell_state(run_dir: Path) -> str:
    """'complete' (final checkpoint and final metrics row), 'resume' (a complete checkpoint) or 'new'."""
    steps = checkpoint_steps(run_dir)
    try:
        cfg = json.loads((run_dir / "config.json").read_text())
        n = int(cfg.get("num_steps_resolved") or cfg["num_steps"])  # dpo.py resolves --num-steps 0 from epochs
    except (OSError, ValueError, KeyError, TypeError):
        return "resume" if steps else "new"
    final_row = n if cfg.get("eval_every") else n - 1  # the final evaluation is logged at step N
    if n in steps and _last_step(run_dir / "metrics.jsonl") >= final_row:
        return "complete"
    return "resume" if steps else "new"


def gpu_slots(gpus: str, per_cell: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each slot that runs a cell (None: leave the environment as it is)."""
    if per_cell <= 0:
        if gpus:
            raise SystemExit(f"--gpus {gpus} needs --gpus-per-cell K (the GPUs each cell gets)")
        return [None]
    if not gpus:
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if not gpus:
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        gpus = ",".join(str(i) for i in range(sum(l.startswith("GPU ") for l in out.splitlines())))
    ids = [g.strip() for g in gpus.split(",") if g.strip()]
    if len(ids) < per_cell:
        raise SystemExit(f"--gpus-per-cell {per_cell} but only {len(ids)} GPU(s) found ({gpus or 'none'}); give "
                         f"--gpus 0,1,... or --gpus-per-cell 0 (cells one after another, environment unchanged)")
    return [",".join(ids[i:i + per_cell]) for i in range(0, len(ids) - per_cell + 1, per_cell)]


class Sweep:
    def __init__(self, base: list[str], grid: dict, sweep_dir: Path, slots: list, base_port: int):
        self.base, self.grid, self.dir, self.slots, self.base_port = base, grid, sweep_dir, slots, base_port
        self.lock, self.stopping, self.procs = threading.Lock(), False, {}
        self.cells = []
        for values in cells_of(grid):
            name = cell_name(values)
            self.cells.append({"name": name, "values": values, "run_dir": str(sweep_dir / name),
                               "log": str(sweep_dir / name / LOG), "status": "pending", "exit_code": None,
                               "command": None, "gpus": None, "seconds": None})
        self.manifest = sweep_dir / "sweep.json"

    def save(self) -> None:
        with self.lock:
            doc = {"name": self.dir.name, "base_command": self.base, "grid": self.grid,
                   "sweep_dir": str(self.dir), "updated": time.strftime("%Y-%m-%d %H:%M:%S"), "cells": self.cells}
            tmp = self.manifest.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc, indent=1))
            tmp.replace(self.manifest)

    def run_cell(self, cell: dict, slot: int) -> None:
        run_dir = Path(cell["run_dir"])
        state = cell_state(run_dir)
        if state == "complete":
            cell["status"] = "complete (skipped)"
            print(f"[sweep] {cell['name']}: complete, skipped", flush=True)
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        cmd = self.base + cell_args(cell["values"]) + ["--out-dir", str(self.dir), "--exp-name", cell["name"]]
        cmd += ["--resume", "latest"] if state == "resume" else []
        # wandb 0.31 reads these two itself (WANDB_CONFIG_PATHS it rejects when set from the environment)
        env = {**os.environ, "WANDB_RUN_GROUP": self.dir.name, "WANDB_TAGS": cell["name"],
               "PET_MASTER_PORT": str(self.base_port + slot)}
        if self.slots[slot] is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.slots[slot]
        cell.update(command=cmd, gpus=self.slots[slot], status="running (resumed)" if state == "resume" else "running")
        self.save()
        print(f"[sweep] {cell['name']}: {'resuming' if state == 'resume' else 'starting'}"
              f"{'' if self.slots[slot] is None else ' on GPU ' + self.slots[slot]}: {shlex.join(cmd)}", flush=True)
        t = time.time()
        with open(run_dir / LOG, "a") as log:  # appended: a resumed cell keeps the killed attempt's output above
            log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n")
            log.flush()
            try:
                p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            except OSError as e:
                log.write(f"could not start: {e}\n")
                cell.update(status="failed", exit_code=127, seconds=0.0)
                return
            with self.lock:
                self.procs[cell["name"]] = p
            rc = p.wait()
            with self.lock:
                self.procs.pop(cell["name"], None)
        ok = rc == 0 and cell_state(run_dir) == "complete"
        status = "complete" if ok else "interrupted" if self.stopping else "failed"
        if rc == 0 and not ok:
            print(f"[sweep] {cell['name']}: exited 0 but its run folder does not hold the final checkpoint and "
                  f"metrics row", flush=True)
        cell.update(status=status, exit_code=rc, seconds=round(time.time() - t, 1))
        print(f"[sweep] {cell['name']}: {status} (exit {rc}, {cell['seconds']:.0f} s, log {run_dir / LOG})",
              flush=True)

    def run(self) -> int:
        todo = queue.Queue()
        for c in self.cells:
            todo.put(c)

        def worker(slot):
            while not self.stopping:
                try:
                    cell = todo.get_nowait()
                except queue.Empty:
                    return
                self.run_cell(cell, slot)
                self.save()

        def on_term(signum, frame):  # stop launching; running cells get SIGTERM, so they checkpoint and leave
            self.stopping = True
            with self.lock:
                for p in self.procs.values():
                    p.send_signal(signal.SIGTERM)

        def on_int(signum, frame):  # Ctrl-C already reached the cells (same process group): stop launching
            self.stopping = True

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_int)
        self.save()
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(self.slots))]
        for th in threads:
            th.start()
        for th in threads:
            while th.is_alive():
                th.join(0.5)
        self.save()
        bad = [c for c in self.cells if c["status"] in ("failed", "interrupted")]
        left = [c for c in self.cells if c["status"] == "pending"]
        done = len(self.cells) - len(bad) - len(left)
        print(f"[sweep] {self.dir.name}: {done}/{len(self.cells)} cells complete, manifest {self.manifest}",
              flush=True)
        for c in bad:
            print(f"[sweep] {c['status'].upper()}: {c['name']} (exit {c['exit_code']}), log {c['log']}", flush=True)
        for c in left:
            print(f"[sweep] not started: {c['name']} (rerun the same command to continue)", flush=True)
        return 1 if bad or left else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="python -m tools.sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cmd", default="", help="the base command as one string (or give it after --)")
    ap.add_argument("--grid", action="append", default=[], help="KEY=V1,V2,... (repeat for more keys)")
    ap.add_argument("--name", default="", help="sweep name: the folder under --out-dir and the wandb group "
                                               "(default: <script>_<grid keys>)")
    ap.add_argument("--out-dir", default="runs_out", help="where the sweep folder goes")
    ap.add_argument("--gpus-per-cell", type=int, default=0,
                    help="GPUs per cell; cells run at once on disjoint GPUs (0: one after another, "
                         "CUDA_VISIBLE_DEVICES left as it is)")
    ap.add_argument("--gpus", default="", help="GPU ids to share out (default: CUDA_VISIBLE_DEVICES, else all)")
    ap.add_argument("--base-port", type=int, default=29600, help="torchrun port of slot i: base + i")
    ap.add_argument("--dry-run", action="store_true", help="print each cell's state and command, run nothing")
    a = ap.parse_args(argv)
    if bool(a.cmd) == bool(rest):
        ap.error("give the base command either with --cmd '...' or after -- (exactly one of them)")
    base = shlex.split(a.cmd) if a.cmd else rest
    grid = parse_grid(a.grid)
    slots = gpu_slots(a.gpus, a.gpus_per_cell)
    check_base(base, grid, len(slots) > 1)
    script = next((Path(t).stem for t in base if t.endswith(".py")), Path(base[0]).name)
    name = a.name or "_".join([script, *grid])
    if not re.fullmatch(r"[A-Za-z0-9._+=-]+", name):
        raise SystemExit(f"--name {name!r}: use letters, digits and ._+=- (it is a folder and a wandb group)")
    sweep = Sweep(base, grid, Path(a.out_dir) / name, slots, a.base_port)
    if sweep.manifest.exists():
        old = json.loads(sweep.manifest.read_text())
        if old.get("base_command") != base:
            raise SystemExit(f"{sweep.manifest} was written for another base command:\n  "
                             f"{shlex.join(old['base_command'])}\nits cells would mix two configurations; use "
                             f"another --name (or delete the folder)")
    if a.dry_run:
        for c in sweep.cells:
            st = cell_state(Path(c["run_dir"]))
            cmd = base + cell_args(c["values"]) + ["--out-dir", str(sweep.dir), "--exp-name", c["name"]]
            print(f"{c['name']}: {st}: {shlex.join(cmd + (['--resume', 'latest'] if st == 'resume' else []))}")
        return 0
    sweep.dir.mkdir(parents=True, exist_ok=True)
    return sweep.run()


if __name__ == "__main__":
    sys.exit(main())
