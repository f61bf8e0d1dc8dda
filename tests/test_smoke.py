"""One end-to-end run of each training script in the default tier: grpo.py, ppo.py, dpo.py, sft.py, rm.py and
grpo_async.py, each from its command line on the tiny model, one step at the smallest size (one rank, a few tokens),
each as `python SCRIPT ...` (conftest.run_scripts). Each must exit 0 and write what a run writes: config.json,
metrics.jsonl with the step's training metrics (finite) and its final checkpoint. What the scripts compute is checked
by the unit tests and by the slow end-to-end tests (2 ranks, resume, learning)."""
import json
import math
from pathlib import Path

import pytest

from conftest import ROOT, run_scripts

GSM8K = ROOT / "tests" / "data" / "gsm8k_tiny.jsonl"
RL = ["--num-steps", "1", "--max-new-tokens", "4", "--eval-every", "0", "--reward-fn", "tests.toy_reward:letters",
      "--lr", "1e-2"]
# script -> (its flags; the training metrics its step row must hold)
RUNS = {
    "grpo": (["grpo.py", *RL, "--prompts-per-step", "2", "--group-size", "2"],
             ["train/loss", "train/grad_norm", "reward/mean", "rollout/response_len_mean"]),
    "ppo": (["ppo.py", *RL, "--prompts-per-step", "2", "--num-minibatches", "1", "--num-epochs", "1"],
            ["train/policy_loss", "train/value_loss", "train/critic_grad_norm", "reward/mean"]),
    "grpo_async": (["grpo_async.py", *RL, "--num-steps", "2", "--prompts-per-step", "2", "--group-size", "2"],
                   ["train/loss", "train/grad_norm", "reward/mean", "rollout/staleness"]),
    "dpo": (["dpo.py", "--num-steps", "1", "--pairs-per-step", "2", "--eval-every", "0", "--max-length", "128",
             "--eval-size", "2"], ["train/loss", "train/grad_norm", "train/rewards/accuracy"]),  # + PAIRS
    "sft": (["sft.py", "--dataset", str(GSM8K), "--num-steps", "1", "--sequences-per-step", "2", "--eval-every", "0",
             "--max-length", "256", "--eval-accuracy-size", "0", "--eval-size", "2"],
            ["train/loss", "train/grad_norm", "train/token_accuracy"]),
    "rm": (["rm.py", "--num-steps", "1", "--pairs-per-step", "2", "--eval-every", "0", "--max-length", "128",
            "--eval-size", "2"], ["train/loss", "train/grad_norm", "train/accuracy"]),
}


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("smoke")
    pairs = out / "pairs.jsonl"  # dpo.py's reference pass covers its whole train set: 8 pairs, not the shipped 488
    pairs.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "chosen": f"It is {2 * i}.",
                                         "rejected": "No idea" + "!" * i}) + "\n" for i in range(8)))
    dpo = ["--dataset", str(pairs), "--eval-fraction", "0.25", "--cache-dir", str(out / "ref_cache")]
    cases = {name: [*argv, "--model", str(tiny_model_dir), "--out-dir", str(out), "--exp-name", name,
                    "--device", "cpu"] + (dpo if name == "dpo" else []) for name, (argv, _) in RUNS.items()}
    return out, run_scripts(cases, out / "driver")


@pytest.mark.parametrize("name", list(RUNS))
def test_script_runs_and_writes_its_metrics(runs, name):
    out, results = runs
    p = results[name]
    assert p.returncode == 0, f"{name}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    run = out / name
    config = json.loads((run / "config.json").read_text())
    assert config["world_size"] == 1 and config["exp_name"] == name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = 2 if name == "grpo_async" else 1
    train = [r for r in rows if RUNS[name][1][0] in r]
    assert [r["step"] for r in train] == list(range(steps)), rows
    for r in train:
        for k in RUNS[name][1]:
            assert k in r and math.isfinite(r[k]), (name, k, r)
    assert train[-1][RUNS[name][1][1]] > 0  # a gradient flowed
    assert (run / "checkpoints" / f"step_{steps:06d}" / "COMPLETE").exists()
    assert f"step    {steps - 1} |" in p.stdout  # the step line every script prints
