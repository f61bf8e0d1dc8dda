"""grpo.py against TRL's GRPOTrainer on the same GSM8K recipe: GSM8K test accuracy against rollout steps and against
minutes of training, one figure, and the table of docs/grpo.md ("Side by side with TRL's GRPOTrainer").

    python3 -m tools.grpo_vs_trl_gsm8k [--run-dir docs/results/grpo_vs_trl_gsm8k_h100_2026-12-06]

The folder holds the runs of dev/queues/trl_gsm8k.txt: grpo/ (grpo.py, its own evaluations in metrics.jsonl), trl/
(bench/trl_gsm8k.py: metrics.jsonl, summary.json) and trl_eval_step<k>/ (grpo.py --num-steps 0 on TRL's step-k
checkpoint: one eval/accuracy row). TRL's step-0 point is grpo.py's step-0 evaluation: the same model and evaluator.
Further runs of grpo.py's recipe named by --extra (folders like grpo/) join the accuracy table, the differences and
the figure: the spread between two runs of one trainer is the noise a difference between trainers is measured against.
Minutes are training time, the sum of perf/step_s of the steps before the evaluation (both trainers time a step the
same way: rollout, scoring and update; evaluations, start-up and checkpoints excluded). The training reward of each
step (the mean over its 64 x 8 samples, the same reward function) is the finer per-step signal: a third panel shows
it (5-step moving average) and a second table its mean per 10-step window over the steps both trainers have, beside
the median step time (and generation time, where the trainer logs it) of each window; the same table follows for
grpo.py beside each --extra run. Writes <run-dir>/curves.png and prints these tables, the accuracy difference with its
standard error at each step two runs both evaluated, the mean per-step difference in training reward of each two
runs, and each run's training reward and step, update and generation times at the --show-steps.

It also prints the step-time table of each same-host pair under --timing-dir (a folder, or its subfolders, holding
grpo/ and trl/ from the queue's `tgrpo` and `ttrl` jobs: a few steps of each trainer, one after the other on one GPU):
seconds per step of each (and of grpo.py's update), the ratio of their medians and means over the steps after
step 0, and each trainer's peak memory where both log it.
"""
import itertools
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import tyro

from tools.compare import load_run, series

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Args:
    run_dir: Path = ROOT / "docs" / "results" / "grpo_vs_trl_gsm8k_h100_2026-12-06"
    """folder with grpo/, trl/ and trl_eval_step<k>/"""
    extra: tuple[str, ...] = ("grpo_stopped_at_step32",)
    """further grpo.py runs of the recipe in run_dir (subfolder names), shown beside the first"""
    timing_dir: Path = ROOT / "docs" / "results" / "grpo_vs_trl_gsm8k_timing_h100_2026-12-06"
    """folder whose pairs (itself or subfolders with grpo/ and trl/) give the same-host step times"""
    show_steps: tuple[int, ...] = (0, 2)
    """steps whose training reward and times are printed for every run (0: before any update; 2: grpo.py's slow
    update)"""


def per_step(run: dict, key: str) -> dict[int, float]:
    """{step: value} of one metric of one run (a tools.compare.load_run result; its series, the run alone)."""
    steps, values, _, _ = series([run], key, "step")
    return dict(zip(steps, values))


def peak(run: dict) -> float | None:
    return max(per_step(run, "perf/peak_mem_gib").values(), default=None)


def warm(step_s: dict[int, float]) -> list[float]:
    """The step times after step 0 (step 0 carries compilation and the first engine step)."""
    return [s for i, s in step_s.items() if i > 0]


def minutes_before(step_s: dict[int, float], k: int) -> float:
    """Training minutes of the steps before step k (steps 0 .. k-1)."""
    return sum(s for i, s in step_s.items() if i < k) / 60


def curves(run_dir: Path, extra: tuple[str, ...] = ()) -> dict[str, dict]:
    """Per run (grpo.py, TRL, then each extra grpo.py run, named by its folder): points [(step, minutes,
    accuracy %)], step times {step: s}, training reward {step: mean}, update and generation times {step: s}
    (grpo.py's perf/update_s and perf/generate_s; TRL logs neither), peak GiB."""
    folders = {"grpo.py": "grpo", "TRL": "trl", **{f"grpo.py ({e}/)": e for e in extra}}
    runs = {name: load_run(run_dir / d) for name, d in folders.items()}
    acc = {name: {k: 100 * a for k, a in per_step(run, "eval/accuracy").items()} for name, run in runs.items()}
    acc["TRL"] = {0: acc["grpo.py"][0]}  # the base model, grpo.py's evaluator
    for d in sorted(run_dir.glob("trl_eval_step*")):
        (a,) = per_step(load_run(d), "eval/accuracy").values()
        acc["TRL"][int(d.name.removeprefix("trl_eval_step"))] = 100 * a
    out = {}
    for name, run in runs.items():
        step_s = per_step(run, "perf/step_s")
        out[name] = {"points": [(k, minutes_before(step_s, k), a) for k, a in sorted(acc[name].items())],
                     "step_s": step_s, "reward": per_step(run, "reward/mean"),
                     "update_s": per_step(run, "perf/update_s"), "generate_s": per_step(run, "perf/generate_s"),
                     "peak": peak(run)}
    return out


def table(c: dict[str, dict]) -> str:
    evals = sorted({k for v in c.values() for k, _, _ in v["points"]})
    head = "| trainer | " + " | ".join(f"accuracy at step {k} (training minutes)" for k in evals) + \
        " | steps run | median s/step (steps 1-) | training minutes | trainer peak GiB |"
    lines = [head, "|---" * (len(evals) + 5) + "|"]
    for name, v in c.items():
        acc = {k: (m, a) for k, m, a in v["points"]}
        peak = "-" if v["peak"] is None else f"{v['peak']:.1f}"
        median, minutes = statistics.median(warm(v["step_s"])), sum(v["step_s"].values()) / 60
        lines.append(f"| {name} | " + " | ".join(f"{acc[k][1]:.2f} % ({acc[k][0]:.1f})" if k in acc else "-"
                                                 for k in evals) +
                     f" | {len(v['step_s'])} | {median:.2f} | {minutes:.1f} | {peak} |")
    return "\n".join(lines)


def differences(c: dict[str, dict], n: int = 1319) -> list[str]:
    """For each two runs, in order, at each step both evaluated (after step 0): the first minus the second, in
    points, with the standard error of that difference for two independent evaluations on n questions."""
    acc = {name: {k: a for k, _, a in v["points"]} for name, v in c.items()}
    out = []
    for n1, n2 in itertools.combinations(acc, 2):
        a1, a2 = acc[n1], acc[n2]
        for k in sorted(set(a1) & set(a2) - {0}):
            p, q = a1[k] / 100, a2[k] / 100
            se = 100 * math.sqrt(p * (1 - p) / n + q * (1 - q) / n)
            out.append(f"step {k}: {n1} - {n2} = {a1[k] - a2[k]:+.2f} points (standard error {se:.2f})")
    return out


def reward_differences(c: dict[str, dict]) -> list[str]:
    """For each two runs, in order: the mean over the steps both have of the per-step training reward difference (the
    first minus the second), with its standard error (the steps' standard deviation / sqrt(steps), as if the steps
    were independent)."""
    out = []
    for n1, n2 in itertools.combinations(c, 2):
        r1, r2 = c[n1]["reward"], c[n2]["reward"]
        d = [r1[k] - r2[k] for k in sorted(set(r1) & set(r2))]
        out.append(f"training reward, {n1} - {n2}: {statistics.mean(d):+.4f} a step over {len(d)} steps "
                   f"(standard error {statistics.stdev(d) / math.sqrt(len(d)):.4f})")
    return out


def window_table(c: dict[str, dict], width: int = 10, names: tuple[str, str] | None = None) -> str:
    """Per window of `width` steps, over the steps two runs (`names`, by default the first two: the two trainers)
    both have (the last window may be shorter): the mean training reward of each, their difference, the median step
    time of each, and the median generation time of those that log it."""
    c = {n: c[n] for n in names or list(c)[:2]}
    common = sorted(set.intersection(*(set(v["reward"]) for v in c.values())))
    names, gen = list(c), [n for n in c if c[n]["generate_s"]]
    lines = ["| steps | " + " | ".join(f"{n}, training reward" for n in names) + f" | {names[0]} - {names[1]} | " +
             " | ".join(f"{n}, median s/step" for n in names) +
             "".join(f" | {n}, median generation s" for n in gen) + " |",
             "|---" * (2 * len(names) + len(gen) + 2) + "|"]
    for lo in range(0, len(common), width):
        win = common[lo:lo + width]
        m = [statistics.mean(c[n]["reward"][i] for i in win) for n in names]
        step = [statistics.median(c[n]["step_s"][i] for i in win) for n in names]
        g = [statistics.median(c[n]["generate_s"][i] for i in win) for n in gen]
        lines.append(f"| {win[0]}-{win[-1]} | " + " | ".join(f"{x:.3f}" for x in m) + f" | {m[0] - m[1]:+.3f} | " +
                     " | ".join(f"{x:.2f}" for x in step) + "".join(f" | {x:.2f}" for x in g) + " |")
    return "\n".join(lines)


def steps_table(c: dict[str, dict], steps: tuple[int, ...]) -> str:
    """Each run's training reward, step time, and update and generation times (where logged) at the given steps."""
    lines = ["| run | step | training reward | s/step | update s | generation s |", "|---" * 6 + "|"]
    for name, v in c.items():
        for k in steps:
            cells = [(v[key].get(k), f) for key, f in (("reward", ".3f"), ("step_s", ".2f"), ("update_s", ".2f"),
                                                        ("generate_s", ".2f"))]
            lines.append(f"| {name} | {k} | " + " | ".join("-" if x is None else format(x, f) for x, f in cells) + " |")
    return "\n".join(lines)


def pairs(timing_dir: Path) -> list[Path]:
    """The same-host step-time pairs: timing_dir itself and its subfolders, each where it holds grpo/ and trl/."""
    return [d for d in (timing_dir, *sorted(timing_dir.iterdir()))
            if d.is_dir() and (d / "grpo").is_dir() and (d / "trl").is_dir()]


def pair_table(pair: Path) -> str:
    """Seconds per step of grpo.py (and of its update) and of TRL in one pair, then TRL / grpo.py by the medians and
    by the means of the steps after step 0."""
    grpo, trl = load_run(pair / "grpo"), load_run(pair / "trl")
    g, u, t = per_step(grpo, "perf/step_s"), per_step(grpo, "perf/update_s"), per_step(trl, "perf/step_s")
    lines = ["| step | grpo.py s | grpo.py update s | TRL s |", "|---|---|---|---|"]
    lines += [f"| {k} | {g[k]:.2f} | {u[k]:.2f} | {t[k]:.2f} |" for k in sorted(set(g) & set(t))]
    gw, tw = warm(g), warm(t)
    gm, tm = statistics.median(gw), statistics.median(tw)
    ga, ta = statistics.mean(gw), statistics.mean(tw)
    lines.append(f"steps 1-: median grpo.py {gm:.2f} s, TRL {tm:.2f} s: {tm / gm:.2f}x; "
                 f"mean {ga:.2f} s, {ta:.2f} s: {ta / ga:.2f}x")
    pg, pt = peak(grpo), peak(trl)
    if pg is not None and pt is not None:
        lines.append(f"trainer peak: grpo.py {pg:.1f} GiB, TRL {pt:.1f} GiB")
    return "\n".join(lines)


def moving_average(values: list[float], k: int = 5) -> list[float]:
    """Mean of each value and up to k-1 before it."""
    return [statistics.mean(values[max(0, i - k + 1):i + 1]) for i in range(len(values))]


def plot(c: dict[str, dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4))
    for (name, v), style in zip(c.items(), ("o-", "s--", "^:", "v-.")):
        steps, mins, acc = zip(*v["points"])
        a1.plot(steps, acc, style, label=name)
        a2.plot(mins, acc, style, label=name)
        rs = sorted(v["reward"])
        a3.plot(rs, moving_average([v["reward"][i] for i in rs]), style[1:], label=name)
    a1.set_xlabel("rollout step (64 prompts x 8 samples)")
    a2.set_xlabel("training minutes (sum of step times)")
    for a in (a1, a2):
        a.set_ylabel("GSM8K test accuracy, % (1,319, greedy)")
    a3.set_xlabel("rollout step")
    a3.set_ylabel("training reward (5-step average)")
    for a in (a1, a2, a3):
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle("Qwen2.5-Coder-0.5B-Instruct, runs/grpo_gsm8k_qwen05b.sh, one H100", y=0.99)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(args: Args) -> None:
    c = curves(args.run_dir, args.extra)
    print(table(c))
    print("\n".join(differences(c)))
    print("\n".join(reward_differences(c)))
    print()
    print(window_table(c))
    for e in list(c)[2:]:
        print()
        print(window_table(c, names=("grpo.py", e)))
    print()
    print(steps_table(c, args.show_steps))
    plot(c, args.run_dir / "curves.png")
    print("wrote", args.run_dir / "curves.png")
    for pair in pairs(args.timing_dir):
        print(f"\nsame-host step times, {pair.relative_to(args.timing_dir.parent)}")
        print(pair_table(pair))


if __name__ == "__main__":
    main(tyro.cli(Args))
