"""One call's W05 results as a table (a call: one run of a queue on one GPU host, dev/gpu_qwen.sh): every sub-run
bench/w05.py wrote under a folder, side by side, each of ours against every TRL run of the same call (issue 20: a
comparison with a peer counts only within one call, and TRL's own step moved 15 % between two runs of one call on
one H200, 2026-12-04, so each ratio is given against each TRL run).

Per grpo sub-run: bench/w05.py's median step over the warm steps and their range, the phases' medians, the device peak
(nvidia-smi) and the trainer's, the engine processes it generated with (its config.json), and whether it trained as the
defaults do: the grad norm's range and the largest clip fraction over the steps after step 0 (from its metrics.jsonl),
and the step-0 engine-vs-trainer log-prob gap. A fast run that trains differently (under a CUDA MPS share of the SMs,
2026-12-03) shows on the same line. The last column checks issue 20's W05 goal for the run: its step at most --goal-step
seconds, at least --goal-ratio times faster than every TRL run of the call, and a device peak no higher than any TRL
run's; "met", or what misses.

Where the folder holds the queue's `status` file (dev/gpu_queue.py: "HH:MM:SS start JOB (gpu G)" lines), the rows
come in the order the jobs started, with a "start" column (the GPU host's clock): a drift of the host's speed over
the call (one H200 on 2026-12-04 was slow for its first minutes) then shows down the table.

Below the table, issue 20's defaults goal where the call has both: each grpo.py run without tuning flags (no
--grpo-extra beyond --vllm.verbose, no bench budget, the scripts' default fused loss) as a share of the speed of the
call's fastest grpo.py run (the goal: >= 90 %).

    python bench/call_table.py docs/results/w05_fa3_decode_cap_repeat_h200_2026-12-04                # every <sub-run>/w05-0.5b/summary.json below
    python bench/call_table.py docs/results/w05_fa3_decode_cap_repeat_h200_2026-12-04 --markdown     # the same as a markdown table
"""
import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/call_table.py` from anywhere
from bench.w05 import SHAPES, parse_args  # noqa: E402
from common.args import RLArgs  # noqa: E402

GOAL_STEP, GOAL_RATIO = 6.3, 3.5  # issue 20's W05 goal: seconds per step, times every TRL run's step of the call


def job_starts(folder: Path) -> dict[str, str]:
    """Each queue job's start time ("HH:MM:SS", the device's clock) from the `status` file dev/gpu_queue.py writes,
    copied beside the sub-runs; {} without one."""
    status = folder / "status"
    if not status.exists():
        return {}
    starts = {}
    for line in status.read_text().splitlines():
        m = re.match(r"(\d\d:\d\d:\d\d) start (\S+) ", line)
        if m:
            starts.setdefault(m.group(2), m.group(1))
    return starts


def load(folder: Path) -> list[dict]:
    """Every sub-run of every summary.json below `folder`, with `label` (the summary's folder relative to `folder`,
    without bench/w05.py's shape folder), `summary` (its path) and `start` (its queue job's start, or None); the build
    step is left out. In the order the jobs started where the queue's status file says, else by folder name."""
    out, starts = [], job_starts(folder)
    for p in sorted(folder.rglob("summary.json")):
        label = p.parent.relative_to(folder)
        start = starts.get(label.parts[0])
        label = str(label.parent if label.name in {f"w05-{shape}" for shape in SHAPES} else label)
        summary = json.loads(p.read_text())
        for run in summary.get("runs", [])[1:]:
            out.append(dict(run, label=label if run.get("kind") == "trl" else f"{label}:{run['name']}",
                            summary=p, start=start, argv=summary.get("argv", [])))
    return sorted(out, key=lambda r: r["start"] or "~")  # stable: by folder name within a job and without a status


def training_check(run: dict) -> dict:
    """Grad norm range and largest clip fraction over the steps after 0, from the run's metrics.jsonl (empty if the
    file is not beside its summary)."""
    path = run["summary"].parent / run["name"] / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    later = [r for r in rows if r.get("step", 0) > 0]
    norms = [r["train/grad_norm"] for r in later if "train/grad_norm" in r]
    clips = [r["train/clip_frac"] for r in later if "train/clip_frac" in r]
    return {"grad_norm": (min(norms), max(norms)) if norms else None, "clip_max": max(clips) if clips else None}


def engines(run: dict) -> str:
    """The number of engine processes the sub-run generated with, from its config.json (--vllm.num-engines as the
    run resolved it, so auto shows its count); "" without the file or the flag (runs from before the flag)."""
    path = run["summary"].parent / run["name"] / "config.json"
    vllm = json.loads(path.read_text()).get("vllm", {}) if path.exists() else {}
    return str(vllm.get("num_engines", ""))


def goal(step: float, ratios: list[float], device_gib: float | None, trl_peak: float | None,
         goal_step: float = GOAL_STEP, goal_ratio: float = GOAL_RATIO) -> str:
    """"met", or each part of the goal the run misses: the step over goal_step, the smallest of its ratios to the
    call's TRL runs under goal_ratio (none without a TRL run), its device peak over trl_peak (the lowest TRL run's;
    a peak not recorded on either side is named, not passed)."""
    misses = [f"{step:.3f} s > {goal_step:g} s"] if step > goal_step else []
    if not ratios:
        misses.append("no TRL run in the call")
    elif min(ratios) < goal_ratio:
        misses.append(f"{min(ratios):.3f}x < {goal_ratio:g}x")
    if device_gib is None or trl_peak is None:
        misses.append("device peak not recorded")
    elif device_gib > trl_peak:
        misses.append(f"device {device_gib:.1f} GiB > TRL's {trl_peak:.1f}")
    return "; ".join(misses) or "met"


def rows(runs: list[dict], goal_step: float = GOAL_STEP,
         goal_ratio: float = GOAL_RATIO) -> tuple[list[str], list[list[str]]]:
    """Header and one row per grpo and TRL sub-run (failed ones and ones without a warm step are named, without
    numbers); other kinds (standalone, verl) are left out."""
    trl = [r for r in runs if r.get("kind") == "trl" and r.get("median_warm_s")]
    trl_peak = min((t["gpu_mem_peak_gib"] for t in trl if t.get("gpu_mem_peak_gib")), default=None)
    timed = any(r.get("start") for r in runs)  # the queue's status file was there: a column of when each job started
    lead = lambda r: [r["label"]] + ([r.get("start") or ""] if timed else [])  # noqa: E731
    head = lead({"label": "sub-run", "start": "start"}) + [
        "s/step", "warm steps", "generate", "reference", "update", "wait", "device GiB", "trainer GiB", "engines",
        "grad norm", "clip max", "step-0 gap"] + [f"vs {t['label']}" for t in trl] + [
        f"goal (<= {goal_step:g} s, >= {goal_ratio:g}x every TRL, device <= TRL)"]
    table = []
    for r in runs:
        if not r.get("ok", True):
            table.append(lead(r) + ["failed"] + [""] * (len(head) - len(lead(r)) - 1))
            continue
        if r.get("kind") == "trl":
            steps = r.get("steps") or []
            cells = lead(r) + [f"{r['median_warm_s']:.2f}", " ".join(f"{s:.2f}" for s in steps[1:]), "", "", "", "",
                               f"{r.get('gpu_mem_peak_gib', 0):.1f}"]
            table.append(cells + [""] * (len(head) - len(cells)))
            continue
        if r.get("kind") != "grpo":
            continue
        if not r.get("warm_steps"):  # ran, but too few steps for bench/w05.py to count one as warm
            table.append(lead(r) + ["no warm step"] + [""] * (len(head) - len(lead(r)) - 1))
            continue
        step = r["step_s"]  # bench/w05.py's median over the warm steps
        check = training_check(r)
        gn, clip, gap = check.get("grad_norm"), check.get("clip_max"), r.get("logprob_gap_mean")
        f = lambda k: f"{r[k]:.2f}" if isinstance(r.get(k), (int, float)) else ""  # noqa: E731
        ratios = [t["median_warm_s"] / step for t in trl]
        table.append(lead(r) + [f"{step:.2f}", f"{min(r['warm_steps']):.2f}-{max(r['warm_steps']):.2f}",
                                f("generate_s"), f("ref_logp_s"), f("update_s"), f("wait_rollout_s"),
                                f"{r.get('gpu_mem_peak_gib', 0):.1f}", f"{r.get('peak_mem_gib', 0):.1f}", engines(r),
                                f"{gn[0]:.3f}-{gn[1]:.3f}" if gn else "", f"{clip:.4f}" if clip is not None else "",
                                f"{gap:.5f}" if gap is not None else ""]
                     + [f"{x:.2f}x" for x in ratios]
                     + [goal(step, ratios, r.get("gpu_mem_peak_gib"), trl_peak, goal_step, goal_ratio)])
    return head, table


NOT_TUNING = {"--vllm.verbose"}  # flags that change what is logged, not how fast the step runs


def tuning_flags(run: dict) -> list[str]:
    """The flags a grpo sub-run ran with beyond W05's shapes: its bench/w05.py command's --grpo-extra words (less
    NOT_TUNING) and --max-tokens-per-microbatch, read by bench/w05.py's own parser, and the fused loss when
    bench/w05.py's --fused-loss set it against the scripts' default (RLArgs.fused_loss)."""
    a = parse_args(run.get("argv", [])[1:])
    words = a.grpo_extra.split() + (["--max-tokens-per-microbatch", str(a.max_tokens_per_microbatch)]
                                    if a.max_tokens_per_microbatch else [])
    fused = {"on": True, "off": False}.get(run.get("fused_loss"), RLArgs.fused_loss)
    words += [] if fused == RLArgs.fused_loss else ["--fused-loss" if fused else "--no-fused-loss"]
    return [w for w in words if w not in NOT_TUNING]


def defaults_check(runs: list[dict], goal_share: float = 0.9) -> list[str]:
    """Issue 20's defaults goal, one line per grpo.py run without tuning flags: its speed (1 / its median step; W05's
    tokens per step are fixed) as a share of the call's fastest grpo.py run's; [] unless the call has a plain run
    and a tuned one."""
    ran = [r for r in runs if r.get("kind") == "grpo" and r.get("ok", True) and r.get("warm_steps")
           and r.get("script", "grpo.py") == "grpo.py"]
    plain = [r for r in ran if not tuning_flags(r)]
    if not plain or len(plain) == len(ran):
        return []
    best = min(ran, key=lambda r: r["step_s"])
    flags = " ".join(tuning_flags(best)) or "no tuning flag"
    shares = [(r, best["step_s"] / r["step_s"]) for r in plain]
    return [f"defaults: {r['label']} {r['step_s']:.2f} s/step = {share:.0%} of the fastest grpo.py run's speed "
            f"({best['label']}, {best['step_s']:.2f} s, {flags}): {'met' if share >= goal_share else 'under'} "
            f"{goal_share:.0%}" for r, share in shares]


def render(head: list[str], table: list[list[str]], markdown: bool) -> str:
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(row) + " |" for row in table])
    widths = [max(len(x) for x in col) for col in zip(head, *table)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in [head] + table)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a call's results (one folder per sub-run, as bench/w05.py's OUT)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--goal-step", type=float, default=GOAL_STEP, help="seconds per step the goal column asks for")
    ap.add_argument("--goal-ratio", type=float, default=GOAL_RATIO, help="times TRL's step (every TRL run of the call)")
    a = ap.parse_args()
    runs = load(a.folder)
    if not runs:
        raise SystemExit(f"no bench/w05.py summary.json below {a.folder}: give the folder its sub-runs wrote to "
                         f"(each sub-run's OUT, e.g. docs/results/w05_fa3_decode_cap_repeat_h200_2026-12-04)")
    print(render(*rows(runs, a.goal_step, a.goal_ratio), a.markdown))
    for line in defaults_check(runs):
        print(("\n" if a.markdown else "") + line)


if __name__ == "__main__":
    main()
