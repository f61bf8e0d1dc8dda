"""Draws docs/results/qwen05b_gsm8k_curves.png from the session-8 runs in docs/results/:
python3 -m tools.learning_curves_qwen05b"""
import json, matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
R = str(__import__("pathlib").Path(__file__).resolve().parent.parent / "docs" / "results") + "/"
load = lambda p: [json.loads(l) for l in open(R + p)]
g, p = load("grpo_gsm8k_qwen05b/metrics.jsonl"), load("ppo_gsm8k_qwen05b/metrics.jsonl")
d_eval = load("dpo_gsm8k_qwen05b/eval/metrics.jsonl")[0]
SEQ = 512  # sampled sequences per step (GRPO 64 x 8, PPO 512 x 1)
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
ge = [r for r in g if "eval/accuracy" in r]
a1.plot([r["step"] * SEQ for r in ge], [100 * r["eval/accuracy"] for r in ge], "o-", label="GRPO (64 x 8 / step, 100 steps)")
pe = [r for r in p if "eval/accuracy" in r]
a1.plot([r["step"] * SEQ for r in pe], [100 * r["eval/accuracy"] for r in pe], "s", ms=8, label="PPO (stopped at step 12: only step 0 evaluated)")
a1.plot([0, 8192], [100 * ge[0]["eval/accuracy"], 100 * d_eval["eval/accuracy"]], "^--",
        label="DPO (8,192 samples -> 534 pairs, 2 epochs)")
a1.axhline(100 * ge[0]["eval/accuracy"] + 15, color="grey", ls=":", lw=1, label="GRPO goal (+15 points)")
a1.set_xlabel("sampled sequences (training)"); a1.set_ylabel("GSM8K test accuracy, % (1,319, greedy)")
a1.set_title("Qwen2.5-Coder-0.5B-Instruct (Q4_K_M dequantised), 1 H200"); a1.legend(fontsize=8); a1.grid(alpha=.3)
a2.plot([r["step"] * SEQ for r in ge], [r["eval/response_len"] for r in ge], "o-", label="GRPO, test (greedy)")
a2.plot([r["step"] * SEQ for r in g if "rollout/response_len_mean" in r],
        [r["rollout/response_len_mean"] for r in g if "rollout/response_len_mean" in r], "-", alpha=.5, lw=1,
        label="GRPO, training samples (T=1)")
a2.plot([r["step"] * SEQ for r in p if "rollout/response_len_mean" in r],
        [r["rollout/response_len_mean"] for r in p if "rollout/response_len_mean" in r], "-", alpha=.7, lw=1,
        label="PPO, training samples (T=1)")
a2.plot([0, 8192], [ge[0]["eval/response_len"], d_eval["eval/response_len"]], "^--", label="DPO, test (greedy)")
a2.set_xlabel("sampled sequences (training)"); a2.set_ylabel("mean response length, tokens")
a2.legend(fontsize=8); a2.grid(alpha=.3)
fig.tight_layout(); fig.savefig(R + "qwen05b_gsm8k_curves.png", dpi=110)
