"""Tracking: a run records itself. Rank 0 gets the real tracker (metrics.jsonl + config + git state in the run
folder, and wandb with --track); other ranks get a stand-in with the same methods, so call sites carry no `if`."""
import dataclasses
import json
import secrets
import subprocess
import sys
import time
import warnings
from pathlib import Path


def git_state(repo: Path) -> dict:
    """Commit sha and uncommitted diff of the code that is running (empty when not in a git checkout)."""
    def git(*a):
        try:
            return subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""
    return {"sha": git("rev-parse", "HEAD").strip(), "diff": git("diff", "HEAD")}


def to_dict(args) -> dict:
    """A dataclass config (nested ones included) plus its @property derived numbers, as plain JSON values."""
    d = {}
    for f in dataclasses.fields(args):
        v = getattr(args, f.name)
        d[f.name] = to_dict(v) if dataclasses.is_dataclass(v) else v
    for name in dir(type(args)):
        if isinstance(getattr(type(args), name), property):
            try:
                d[name] = getattr(args, name)
            except Exception:  # a derived number that needs the world size is filled in by the script
                pass
    return d


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a metrics/samples file; a torn line (a run killed mid-write) is dropped with a warning."""
    rows, torn = [], []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError(line)
            rows.append(row)
        except ValueError:
            torn.append(i)
    if torn:
        warnings.warn(f"{path}: dropped {len(torn)} torn line(s) (line {', '.join(map(str, torn))}: not valid JSON, "
                      "a run killed while writing it)")
    return rows


SEGMENT_VOLATILE = ("argv", "resume", "resumed_from", "time")  # differ at every resume: not reported as changes


def config_changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """"name old -> new" for each setting in both configs whose value differs (nested ones as fsdp.x)."""
    out = []
    for k in new:
        if k not in old or k in SEGMENT_VOLATILE:
            continue
        a, b = old[k], json.loads(json.dumps(new[k], default=str))  # as config.json holds it (tuples as lists)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k} {a!r} -> {b!r}")
    return out


def keep_segments(run_dir: Path, config: dict, resume: bool) -> None:
    """Each segment of a resumed run keeps its settings: config.json and git.diff are the latest segment's, and a
    resume first moves the previous ones to config.N.json and git.N.diff (N = 1 for the first segment), then prints
    the settings that changed. A fresh start (--overwrite) removes the numbered ones of the run it replaces."""
    numbered = sorted(run_dir.glob("config.[0-9]*.json")) + sorted(run_dir.glob("git.[0-9]*.diff"))
    if not resume:
        for p in numbered:
            p.unlink()
        return
    last = run_dir / "config.json"
    if not last.is_file():
        return
    n = 1 + max([int(p.name.split(".")[1]) for p in numbered if p.name.split(".")[1].isdigit()], default=0)
    try:
        changes = config_changes(json.loads(last.read_text()), config)
    except ValueError:
        changes = ["(the previous config.json is not valid JSON)"]
    last.rename(run_dir / f"config.{n}.json")
    if (run_dir / "git.diff").is_file():
        (run_dir / "git.diff").rename(run_dir / f"git.{n}.diff")
    print(f"resuming with {'changed settings: ' + '; '.join(changes) if changes else 'the same settings'} "
          f"(segment {n}'s are in config.{n}.json)", flush=True)


class NullTracker:
    """What non-zero ranks (and nothing else) get: same methods, does nothing."""
    run_dir: Path | None = None

    def log(self, metrics: dict, step: int) -> None: ...
    def log_samples(self, rows: list[dict], step: int) -> None: ...
    def finish(self) -> None: ...


class Tracker(NullTracker):
    def __init__(self, run_dir: Path, config: dict, track: bool, project: str, name: str,
                 resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        repo = Path(__file__).resolve().parent.parent
        git = git_state(repo)
        config = {**config, "git_sha": git["sha"], "argv": sys.argv}
        resume = resume_step is not None
        keep_segments(self.run_dir, config, resume)  # a resumed run keeps the earlier segments' config and diff
        (self.run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        (self.run_dir / "git.diff").write_text(git["diff"])
        if resume:  # drop what the killed run logged after its checkpoint, so every step appears exactly once
            for name_ in ("metrics.jsonl", "samples.jsonl"):
                path = self.run_dir / name_
                if path.exists():
                    keep = [r for r in read_jsonl(path) if r["step"] < resume_step]
                    tmp = path.with_suffix(".tmp")
                    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
                    tmp.replace(path)
        mode = "a" if resume else "w"
        self.metrics = open(self.run_dir / "metrics.jsonl", mode)
        self.samples = open(self.run_dir / "samples.jsonl", mode)
        self.wandb = None
        if track:
            import wandb
            # the wandb run's id lives in the run folder: a resumed run continues its own wandb run, never a new
            # one and never another run's of the same name; a fresh run (or --overwrite) gets a new id
            id_file = self.run_dir / "wandb_id.txt"
            run_id = id_file.read_text().strip() if resume and id_file.is_file() else secrets.token_hex(4)
            id_file.write_text(run_id + "\n")
            self.wandb = wandb.init(project=project, name=name, config=config, dir=str(self.run_dir), id=run_id,
                                    resume="allow" if resume else None)
            if git["diff"]:
                art = wandb.Artifact("git-diff", type="code")
                art.add_file(str(self.run_dir / "git.diff"))
                self.wandb.log_artifact(art)

    def log(self, metrics: dict, step: int) -> None:
        row = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        if self.wandb:
            self.wandb.log(metrics, step=step)

    def log_samples(self, rows: list[dict], step: int) -> None:
        for r in rows:
            self.samples.write(json.dumps({"step": step, **r}) + "\n")
        self.samples.flush()
        if self.wandb and rows:
            import wandb
            cols = list(rows[0])
            self.wandb.log({"samples": wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in rows])},
                           step=step)

    def finish(self) -> None:
        self.metrics.close()
        self.samples.close()
        if self.wandb:
            self.wandb.finish()


def make_tracker(is_main: bool, run_dir: Path, config: dict, track: bool, project: str, name: str,
                 resume_step: int | None = None) -> NullTracker:
    """resume_step: the step a resumed run starts at (rows logged at or after it by the killed run are dropped)."""
    return Tracker(run_dir, config, track, project, name, resume_step) if is_main else NullTracker()


def print_table(title: str, rows: dict) -> str:
    """A two-column table of derived numbers, printed at start so the batch geometry is visible."""
    w = max(len(k) for k in rows)
    lines = [title, "-" * (w + 14)] + [f"{k:<{w}}  {v}" for k, v in rows.items()]
    return "\n".join(lines)


class timed:
    """`with timed(perf, "generate"):` adds the phase's wall seconds to perf["generate_s"] (GPU work synchronised)
    and, on a GPU, its peak torch memory to perf["generate_peak_gib"] (torch's counter is reset at every phase,
    so the step's peak comes from `step_peak_gib()`). Allocations outside torch's allocator (vLLM's KV cache and
    weights, in their own pool) are not in the counter."""

    def __init__(self, perf: dict, name: str):
        self.perf, self.key, self.name = perf, f"{name}_s", name

    def __enter__(self):
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            _fold_peak()
            torch.cuda.reset_peak_memory_stats()
        self.label = torch.profiler.record_function(self.name)  # names the phase in a --profile-step trace
        self.label.__enter__()
        self.t = time.perf_counter()

    def __exit__(self, *exc):
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            key = f"{self.name}_peak_gib"
            self.perf[key] = max(self.perf.get(key, 0.0), _fold_peak() / 2**30)
        self.perf[self.key] = self.perf.get(self.key, 0.0) + time.perf_counter() - self.t
        self.label.__exit__(*exc)


_step_peak = 0  # bytes: torch's peak counter, folded in at every phase boundary since the last step_peak_gib()
_engine_pool = 0  # bytes of torch's counter that are a vLLM engine's pool, not the trainer's (count_engine_pool)


def count_engine_pool(nbytes: int) -> None:
    """A vLLM engine on this process allocated `nbytes` through torch (its weights and KV cache): torch's counters
    include them for the whole run, asleep or awake. common/perf.py reports the step's peak without them too."""
    global _engine_pool
    _engine_pool += max(0, int(nbytes))


def engine_pool_gib() -> float:
    return _engine_pool / 2**30


def _fold_peak() -> int:
    """Fold torch's peak-memory counter (since its last reset) into the step's peak; return the counter."""
    global _step_peak
    import torch
    peak = torch.cuda.max_memory_allocated()
    _step_peak = max(_step_peak, peak)
    return peak


def step_peak_gib() -> float:
    """The peak torch memory in GiB since the last call, over the timed phases and what ran between them; resets
    torch's counter for the next step. GPU only."""
    global _step_peak
    import torch
    _fold_peak()
    torch.cuda.reset_peak_memory_stats()
    peak, _step_peak = _step_peak, 0
    return peak / 2**30


class Profile:
    """torch.profiler over part of one step (`--profile-step`): `p = Profile(on, path)` ... `p.stop(is_main)` writes
    the top kernels by GPU time to `path`.txt (and prints them) and, with `trace`, a Chrome trace to
    `path`.json.gz (rank 0). With `python`, cProfile runs alongside and `path`_py.txt gets the Python functions by
    own time and by cumulative time: where the host time goes in a host-bound phase, which the kernel table cannot
    show (it slows the profiled step further). With `engine` in a process of its own (common.engine_process), its
    next generate is profiled there too: `path`_engine.txt, the engine's kernels (grpo_async.py: the background
    generation that runs beside this step's learning phases; rank 0's engine only). Does nothing when `on` is False."""

    def __init__(self, on: bool, path: Path, trace: bool = True, python: bool = False, engine=None):
        import torch
        self.path, self.prof, self.trace, self.py = Path(path), None, trace, None
        from common.dist import rank
        if on and hasattr(engine, "profile_next") and rank() == 0:  # rank 0's engine, as rank 0 writes the tables
            engine.profile_next(self.path.with_name(self.path.name + "_engine"))
        if on:
            acts = [torch.profiler.ProfilerActivity.CPU] + \
                ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
            if python:
                import cProfile
                self.py = cProfile.Profile()
                self.py.enable()

    def stop(self, is_main: bool) -> None:
        import torch
        if self.prof is None:
            return
        if self.py is not None:
            self.py.disable()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        if is_main:
            sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            table = self.prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.with_suffix(".txt").write_text(table)
            if self.trace:
                self.prof.export_chrome_trace(str(self.path.with_suffix(".json.gz")))
            print(f"profile ({self.path}.txt{', .json.gz' if self.trace else ''}):\n{table}", flush=True)
            if self.py is not None:
                import io
                import pstats
                out = io.StringIO()
                for order in ("tottime", "cumulative"):
                    pstats.Stats(self.py, stream=out).sort_stats(order).print_stats(40)
                self.path.with_name(self.path.name + "_py.txt").write_text(out.getvalue())
        self.prof = self.py = None


class Progress:
    """Rank 0's progress bar (steps done, reward, seconds per step) kept under the per-step lines; on other ranks,
    or when stderr is not a terminal (CI logs), only the lines are printed."""

    def __init__(self, enabled: bool, total: int, start: int = 0):
        self.enabled, self.bar, self.step = enabled, None, start  # step: steps done (start + one per update)
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, disable=None, leave=False)

    def update(self, line: str, **postfix: float) -> None:
        self.step += 1
        if not self.enabled:
            return
        if self.bar is None or self.bar.disable:
            print(line, flush=True)
            return
        self.bar.write(line)
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in postfix.items()}, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
