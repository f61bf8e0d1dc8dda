"""grpo.py against TRL's GRPOTrainer on the same GSM8K recipe: GSM8K test accuracy against rollout steps and against
minutes of training, one figure, and the table of docs/grpo.md ("Side by side with TRL's GRPOTrainer").

    python3 -m tools.grpo_vs_trl_gsm8k [--run-dir docs/results/grpo_vs_trl_gsm8k_h100_2026-12-06]

The folder holds the runs of dev/queues/trl_gsm8k.txt: grpo/ (grpo.py, its own evaluations in metrics.jsonl), trl/
(bench/trl_gsm8k.py: metrics.jsonl, summary.json) and trl_eval_step<k>/ (grpo.py --num-steps 0 on TRL's step-k
checkpoint: one eval/accuracy row). TRL's step-0 point is grpo.py's step-0 evaluation: the same model and evaluator.
Minutes are training time, the sum of perf/step_s of the steps before the evaluation (both trainers time a step the
same way: rollout, scoring and update; evaluations, start-up and checkpoints excluded). Writes <run-dir>/curves.png
and prints the table.
"""
import statistics
from dataclasses import dataclass
from pathlib import Path

import tyro

from tools.compare import load_run

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Args:
    run_dir: Path = ROOT / "docs" / "results" / "grpo_vs_trl_gsm8k_h100_2026-12-06"
    """folder with grpo/, trl/ and trl_eval_step<k>/"""


def rows(run: Path) -> list[dict]:
    return load_run(run)["rows"]


def minutes_before(step_s: dict[int, float], k: int) -> float:
    """Training minutes of the steps before step k (steps 0 .. k-1)."""
    return sum(s for i, s in step_s.items() if i < k) / 60


def curves(run_dir: Path) -> dict[str, dict]:
    """Per trainer: points [(step, minutes, accuracy %)], step times {step: s}, peak GiB."""
    g = rows(run_dir / "grpo")
    g_step = {r["step"]: r["perf/step_s"] for r in g if "perf/step_s" in r}
    g_eval = {r["step"]: 100 * r["eval/accuracy"] for r in g if "eval/accuracy" in r}
    t = rows(run_dir / "trl")
    t_step = {r["step"]: r["perf/step_s"] for r in t if "perf/step_s" in r}
    t_eval = {0: g_eval[0]}  # the base model, grpo.py's evaluator
    for d in sorted(run_dir.glob("trl_eval_step*")):
        (r,) = [r for r in rows(d) if "eval/accuracy" in r]
        t_eval[int(d.name.removeprefix("trl_eval_step"))] = 100 * r["eval/accuracy"]
    out = {}
    for name, step_s, ev, rs in (("grpo.py", g_step, g_eval, g), ("TRL", t_step, t_eval, t)):
        out[name] = {"points": [(k, minutes_before(step_s, k), a) for k, a in sorted(ev.items())], "step_s": step_s,
                     "peak": max((r["perf/peak_mem_gib"] for r in rs if "perf/peak_mem_gib" in r), default=None)}
    return out


def table(c: dict[str, dict]) -> str:
    evals = sorted({k for v in c.values() for k, _, _ in v["points"]})
    head = "| trainer | " + " | ".join(f"accuracy at step {k}" for k in evals) + \
        " | median s/step (steps 1-) | training minutes | trainer peak GiB |"
    lines = [head, "|---" * (len(evals) + 4) + "|"]
    for name, v in c.items():
        acc = {k: a for k, _, a in v["points"]}
        warm = [s for i, s in v["step_s"].items() if i > 0]
        lines.append(f"| {name} | " + " | ".join(f"{acc[k]:.2f} %" if k in acc else "-" for k in evals) +
                     f" | {statistics.median(warm):.2f} | {sum(v['step_s'].values()) / 60:.1f} | "
                     f"{v['peak']:.1f} |")
    return "\n".join(lines)


def plot(c: dict[str, dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10.5, 4))
    for (name, v), style in zip(c.items(), ("o-", "s--")):
        steps, mins, acc = zip(*v["points"])
        a1.plot(steps, acc, style, label=name)
        a2.plot(mins, acc, style, label=name)
    a1.set_xlabel("rollout step (64 prompts x 8 samples)")
    a2.set_xlabel("training minutes (sum of step times)")
    for a in (a1, a2):
        a.set_ylabel("GSM8K test accuracy, % (1,319, greedy)")
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle("Qwen2.5-Coder-0.5B-Instruct, runs/grpo_gsm8k_qwen05b.sh, one H100")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(args: Args) -> None:
    c = curves(args.run_dir)
    print(table(c))
    plot(c, args.run_dir / "curves.png")
    print("wrote", args.run_dir / "curves.png")


if __name__ == "__main__":
    main(tyro.cli(Args))
