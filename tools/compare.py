"""Compare runs: chosen metrics against step or sampled sequences in one PNG, and a markdown table of final values.

    python -m tools.compare runs_out/loss_agg --metrics eval/accuracy reward/mean --x sequences --out fig.png
    python -m tools.compare runs_out/a runs_out/b --metrics train/loss
    python -m tools.compare runs_out/a runs_out/b --labels plain tool --max-step 40   # equal samples, named curves

RUN_DIR is a run folder (metrics.jsonl + config.json) or a folder of them (a sweep). Runs are labelled by the config
keys whose values differ between them (out_dir, exp_name, git, argv, paths and timings are ignored); runs that
differ only in seed are drawn as their mean with a min/max band. --x sequences puts sequences sampled before the
step on the x axis (step x sequences_per_step from config.json, i.e. prompts x group size). The table (one row per
curve; final value = the metric's last logged row) is printed and written next to the figure (fig.md).
docs/sweeps.md.
"""
import argparse
import json
import sys
from pathlib import Path

# Keys that differ between any two runs without saying anything about the configuration.
IGNORED = {"out_dir", "exp_name", "git_sha", "argv", "resumed_from", "model_path", "export_hf", "resume",
           "time", "timestamp", "start_time", "hostname", "track", "wandb_project", "log_samples_every",
           "profile_step", "cache_dir"}
SEED = "seed"


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, list) else v
    return out


def find_runs(paths: list[str]) -> list[Path]:
    """Run folders among the paths, a folder without metrics.jsonl standing for the run folders inside it."""
    runs = []
    for p in map(Path, paths):
        if (p / "metrics.jsonl").is_file():
            runs.append(p)
        elif p.is_dir() and (found := sorted(q.parent for q in p.glob("*/metrics.jsonl"))):
            runs += found
        else:
            raise SystemExit(f"{p}: no metrics.jsonl there nor in its sub-folders; give run folders "
                             f"(<out-dir>/<exp-name>) or a sweep folder")
    return runs


def load_run(path: Path) -> dict:
    if not (path / "config.json").is_file():
        raise SystemExit(f"{path}: no config.json (every run writes it at step 0); is this a run folder?")
    rows = []
    for i, line in enumerate((path / "metrics.jsonl").read_text().splitlines()):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"warning: {path}/metrics.jsonl line {i + 1} is not JSON (cut by a kill?); skipped", file=sys.stderr)
    return {"path": path, "config": flatten(json.loads((path / "config.json").read_text())), "rows": rows}


def differing_keys(configs: list[dict]) -> list[str]:
    """Config keys whose values are not the same in all the runs that record them, ignored keys left out. A key
    some runs lack (a flag added after they ran) is not a difference by itself: their value is unknown."""
    keys = sorted(set().union(*configs) - IGNORED)
    return [k for k in keys if len({json.dumps(c[k], sort_keys=True, default=str) for c in configs if k in c}) > 1]


def sequences_per_step(run: dict) -> float:
    c = run["config"]
    if c.get("sequences_per_step"):
        return c["sequences_per_step"]
    if c.get("prompts_per_step") and c.get("group_size"):
        return c["prompts_per_step"] * c["group_size"]
    raise SystemExit(f"--x sequences: {run['path']}/config.json has neither sequences_per_step nor prompts_per_step "
                     f"and group_size; use --x step")


def groups_of(runs: list[dict]) -> tuple[list[str], list[tuple[dict, list[dict]]]]:
    """The differing keys and the curves: runs with equal values of every differing key but the seed share one."""
    keys = differing_keys([r["config"] for r in runs])
    label_keys = [k for k in keys if k != SEED]
    groups: dict[str, tuple[dict, list]] = {}
    for r in runs:
        vals = {k: r["config"].get(k) for k in label_keys}
        groups.setdefault(json.dumps(vals, sort_keys=True, default=str), (vals, []))[1].append(r)
    return keys, list(groups.values())


def series(group: list[dict], metric: str, x: str) -> tuple[list[float], list[float], list[float], list[float]]:
    """x, mean, min, max of the metric over the group's runs, at each x any run logged it."""
    at: dict[float, list[float]] = {}
    for r in group:
        scale = sequences_per_step(r) if x == "sequences" else 1
        for row in r["rows"]:
            if metric in row and row[metric] is not None:
                at.setdefault(row["step"] * scale, []).append(float(row[metric]))
    xs = sorted(at)
    return (xs, [sum(at[v]) / len(at[v]) for v in xs], [min(at[v]) for v in xs], [max(at[v]) for v in xs])


def final(run: dict, metric: str) -> float | None:
    vals = [row[metric] for row in run["rows"] if row.get(metric) is not None]
    return float(vals[-1]) if vals else None


def label(vals: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in vals.items()) or "run"


def fmt(v) -> str:
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def table(keys: list[str], groups: list, metrics: list[str], labels: list[str] | None = None) -> str:
    """Markdown: one row per curve, its label (with --labels) or the differing keys (seeds listed), then each
    metric's final value (mean, and [min, max] over seeds)."""
    named = [k for k in keys if k != SEED] if labels is None else ["run"]
    cols = named + (["seeds"] if SEED in keys else []) + ["runs"] + metrics
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for i, (vals, runs) in enumerate(groups):
        cells = [fmt(vals[k]) for k in keys if k != SEED] if labels is None else [labels[i]]
        if SEED in keys:
            cells.append(",".join(str(r["config"].get(SEED)) for r in runs))
        cells.append(str(len(runs)))
        for m in metrics:
            f = [v for r in runs if (v := final(r, m)) is not None]
            cells.append("n/a" if not f else fmt(f[0]) if len(f) == 1 else
                         f"{fmt(sum(f) / len(f))} [{fmt(min(f))}, {fmt(max(f))}]")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compare(run_dirs: list[str], metrics: list[str], x: str = "step", labels: list[str] | None = None,
            max_step: int | None = None):
    """The figure (one panel per metric) and the markdown table. labels: one per curve, in the order the curves
    come (the runs' order; a sweep folder's runs sorted by name), instead of the differing keys. max_step: rows
    after that step are dropped, so runs of different lengths compare at equal samples (figure and table)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [load_run(p) for p in find_runs(run_dirs)]
    if max_step is not None:
        for r in runs:
            r["rows"] = [row for row in r["rows"] if row["step"] <= max_step]
    logged = set().union(*({k for row in r["rows"] for k in row} for r in runs))
    missing = [m for m in metrics if m not in logged]
    if missing:
        have = ", ".join(sorted(logged - {"step", "time"}))
        raise SystemExit(f"--metrics {' '.join(missing)}: no run logged it; the runs have: {have}")
    keys, groups = groups_of(runs)
    if labels is not None and len(labels) != len(groups):
        found = "; ".join(label(vals) for vals, _ in groups)
        raise SystemExit(f"--labels: {len(labels)} given for {len(groups)} curves; give one per curve, in this "
                         f"order: {found}")
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        for i, (vals, group) in enumerate(groups):
            xs, mean, lo, hi = series(group, m, x)
            if not xs:
                continue
            n = len(group)
            line, = ax.plot(xs, mean, marker="." if len(xs) < 30 else None, color=f"C{i % 10}",  # a curve's colour
                            label=(labels[i] if labels else label(vals)) + (f" ({n} seeds)" if n > 1 else ""))
            if n > 1:
                ax.fill_between(xs, lo, hi, alpha=0.2, color=line.get_color(), linewidth=0)
        ax.set_title(m)
        ax.set_xlabel("sequences sampled" if x == "sequences" else "step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    return fig, table(keys, groups, metrics, labels)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run folders, or folders of run folders (a sweep)")
    ap.add_argument("--metrics", nargs="+", default=["eval/accuracy", "reward/mean"],
                    help="metric keys, one panel each")
    ap.add_argument("--x", choices=["step", "sequences"], default="step", help="x axis")
    ap.add_argument("--out", default="compare.png", help="the PNG; the table goes next to it as .md")
    ap.add_argument("--labels", nargs="+", help="one name per curve, in the runs' order (default: the differing "
                    "config keys)")
    ap.add_argument("--max-step", type=int, help="drop rows after this step: runs of different lengths compared at "
                    "equal samples (the table's final values are at or before it)")
    a = ap.parse_args(argv)
    fig, md = compare(a.runs, a.metrics, a.x, a.labels, a.max_step)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    print(f"\nwrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
