"""Draws docs/results/learning_curves_qwen05b_gsm8k/qwen05b_gsm8k_curves.png from the runs in docs/results/: GRPO's
recipe at seed 2 with --tis-cap 2 and at seed 1, GRPO with --format-coef 0.1 (faint), PPO (stopped after step 77), DPO
on the policy's own samples and the SFT warm start's export: GSM8K test accuracy and mean response length against
sampled sequences. Each run's folder README has its command, commit, hardware and date.
    python3 -m tools.learning_curves_qwen05b"""
import json
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

R = Path(__file__).resolve().parent.parent / "docs" / "results"
SEQ = 512  # sampled sequences per step (GRPO 64 x 8, PPO 512 x 1)
RUNS = [  # (label, run folder, marker style, colour, faint)
    ("GRPO recipe, seed 2, --tis-cap 2", "grpo_lr_seed2/lr=2e-6", "o-", "C0", False),
    ("GRPO recipe, seed 1", "grpo_gsm8k_qwen05b_nofmt", "o--", "C5", False),
    ("GRPO recipe, seed 1, --format-coef 0.1", "grpo_gsm8k_qwen05b", "o:", "C1", True),
    ("PPO recipe, seed 1 (stopped at step 77)", "ppo_gsm8k_qwen05b", "s-", "C2", False),
]


def load(name: str) -> list[dict]:
    return [json.loads(line) for line in open(R / name) if line.strip().startswith("{")]


fig, (a1, a2) = plt.subplots(1, 2, figsize=(11.5, 4.4))
for label, run, style, col, faint in RUNS:
    rows = load(f"{run}/metrics.jsonl")
    ev = [r for r in rows if "eval/accuracy" in r]
    steps = sum(1 for r in rows if "perf/step_s" in r)
    alpha = 0.6 if faint else 1.0
    a1.plot([r["step"] * SEQ for r in ev], [100 * r["eval/accuracy"] for r in ev], style, color=col, alpha=alpha,
            label=f"{label}, {steps} steps")
    a2.plot([r["step"] * SEQ for r in ev], [r["eval/response_len"] for r in ev], style, color=col, alpha=alpha,
            label=f"{label.split(' (')[0]}, test (greedy)")
    if not faint:
        tr = [r for r in rows if "rollout/response_len_mean" in r]
        a2.plot([r["step"] * SEQ for r in tr], [r["rollout/response_len_mean"] for r in tr], "-", color=col, lw=0.8,
                alpha=0.4, label=f"{label.split(' (')[0]}, training samples (T=1)")
base = load("grpo_gsm8k_qwen05b_nofmt/metrics.jsonl")[0]
assert base["step"] == 0 and "eval/accuracy" in base
d_eval = load("dpo_gsm8k_qwen05b/eval/metrics.jsonl")[0]  # dpo.py's policy after 2 epochs on 534 pairs (8,192 samples)
a1.plot([0, 8192], [100 * base["eval/accuracy"], 100 * d_eval["eval/accuracy"]], "^--", color="C3",
        label="DPO recipe, 534 pairs from 8,192 own samples, 2 epochs")
a2.plot([0, 8192], [base["eval/response_len"], d_eval["eval/response_len"]], "^--", color="C3", label="DPO recipe, test (greedy)")
sft = [r for r in load("grpo_gsm8k_qwen05b_from_sft/metrics.jsonl") if "eval/accuracy" in r][0]
a1.plot([0], [100 * sft["eval/accuracy"]], "*", ms=12, color="C4", label="SFT recipe, 40 steps: its export's accuracy")
a2.plot([0], [sft["eval/response_len"]], "*", ms=12, color="C4", label="SFT recipe, 40 steps, test (greedy)")
a1.set_xlabel("sampled sequences (training)"); a1.set_ylabel("GSM8K test accuracy, % (1,319, greedy)")
a1.set_title("Qwen2.5-Coder-0.5B-Instruct (Q4_K_M dequantised), 1 H200"); a1.legend(fontsize=7); a1.grid(alpha=.3)
a2.set_xlabel("sampled sequences (training)"); a2.set_ylabel("mean response length, tokens")
a2.legend(fontsize=7); a2.grid(alpha=.3)
out = R / "learning_curves_qwen05b_gsm8k" / "qwen05b_gsm8k_curves.png"
fig.tight_layout(); fig.savefig(out, dpi=110)
print("wrote", out)
