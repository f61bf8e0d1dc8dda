"""Bad input to grpo.py: each fails (or degrades) with a message that says what is wrong and what to change."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, torchrun

TINY = ["--num-steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-every", "0"]


def run_grpo(*args, tmp_path, check=False):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    p = subprocess.run([sys.executable, "grpo.py", *args, "--out-dir", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_missing_dataset_field(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"problem": "1+1?", "answer": "2"}] * 4)
    p = run_grpo("--model", str(tiny_model_dir), "--dataset", str(data), *TINY, tmp_path=tmp_path)
    assert p.returncode != 0
    assert "question" in p.stderr and "problem" in p.stderr and "--prompt-field" in p.stderr


def test_verl_shaped_rows_with_a_system_prompt(tiny_model_dir, tmp_path):
    """A verl-style dataset (the prompt a chat, the answer at reward_model.ground_truth) trains as it is; the system
    prompt and the template variables reach the prompts the run sampled from."""
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "reward_model": {"ground_truth": str(i + 1)}} for i in range(4)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    run_grpo("--model", str(tiny_model_dir), "--dataset", str(data), "--prompt-field", "prompt", "--answer-field",
             "reward_model.ground_truth", "--system-prompt", "You add one.", "--chat-template-kwargs",
             '{"unused": true}', "--log-samples-every", "1", "--exp-name", "verl", *TINY, tmp_path=tmp_path,
             check=True)
    samples = [json.loads(l) for l in open(tmp_path / "verl" / "samples.jsonl")]
    assert samples and all("You add one." in s["prompt"] and " + 1?" in s["prompt"] for s in samples), samples[0]
    assert {s["answer"] for s in samples} <= {"1", "2", "3", "4"}


def test_overlong_prompts_dropped_and_counted(tiny_model_dir, tmp_path):
    rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(4)]
    rows += [{"question": "word " * 400, "answer": "#### 0"}] * 2
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    p = run_grpo("--model", str(tiny_model_dir), "--dataset", str(data), "--max-prompt-tokens", "120",
                 "--eval-fraction", "0", "--exp-name", "long", *TINY, tmp_path=tmp_path, check=True)  # all rows train
    cfg = json.loads((tmp_path / "long" / "config.json").read_text())
    assert cfg["train_prompts"] == 4 and cfg["train_prompts_dropped_too_long"] == 2
    assert "4 (2)" in p.stdout  # the geometry table shows kept (dropped)


def test_reward_function_that_raises_scores_zero_and_is_counted(tiny_model_dir, tmp_path):
    p = run_grpo("--model", str(tiny_model_dir), "--reward-fn", "tests.bad_reward:sometimes_raises",
                 "--exp-name", "raise", "--temperature", "1.0", *TINY[:3], "4", *TINY[4:], tmp_path=tmp_path)
    rows = [json.loads(l) for l in open(tmp_path / "raise" / "metrics.jsonl")]
    if p.returncode != 0:  # every sample happened to raise: that stops the run, with the sample in the message
        assert "cannot parse this completion" in p.stderr
    else:
        assert rows[0]["reward/errors"] > 0
        assert "cannot parse this completion" in p.stdout  # the first error is printed with its sample


def test_reward_function_that_always_raises_stops_the_run(tiny_model_dir, tmp_path):
    p = run_grpo("--model", str(tiny_model_dir), "--reward-fn", "tests.bad_reward:always_raises", *TINY,
                 tmp_path=tmp_path)
    assert p.returncode != 0
    assert "KeyError" in p.stderr and "answer" in p.stderr


def test_custom_reward_fn_missing(tiny_model_dir, tmp_path):
    p = run_grpo("--model", str(tiny_model_dir), "--reward-fn", "tests.bad_reward:nope", *TINY, tmp_path=tmp_path)
    assert p.returncode != 0 and "nope" in p.stderr


@pytest.mark.parametrize("flags,names", [
    (["--num-minibatches", "3"], "--num-minibatches"),
    (["--max-tokens-per-microbatch", "64"], "--max-tokens-per-microbatch"),
    (["--temperature", "0"], "--temperature 0.0"),
    (["--max-tokens-per-forward", "64"], "--max-tokens-per-forward 64"),
    (["--engine-logprobs-every", "-1"], "--engine-logprobs-every -1"),
])
def test_batch_geometry_that_does_not_divide(tiny_model_dir, tmp_path, flags, names):
    p = run_grpo("--model", str(tiny_model_dir), *TINY, *flags, tmp_path=tmp_path)
    assert p.returncode != 0 and names in p.stderr


@pytest.mark.slow
def test_prompts_not_divisible_by_ranks(tiny_model_dir, tmp_path):
    p = torchrun("grpo.py", "--model", str(tiny_model_dir), *TINY[:2], "--prompts-per-step", "3", *TINY[4:],
                 "--out-dir", str(tmp_path), nproc=2, check=False)
    assert p.returncode != 0 and "--prompts-per-step 3 must be divisible" in p.stderr


def test_unknown_model_path(tmp_path):
    p = run_grpo("--model", str(tmp_path / "no-such-model"), *TINY, tmp_path=tmp_path)
    assert p.returncode != 0
    assert "no-such-model" in p.stderr and "Pass a local HF folder" in p.stderr


def test_non_finite_loss_skips_updates_then_stops(tiny_model_dir, tmp_path):
    """A NaN loss (here from --entropy-coef nan) skips the update, is logged, and stops the run after
    --max-bad-updates in a row with a message that says what to do."""
    p = run_grpo("--model", str(tiny_model_dir), "--entropy-coef", "nan", "--max-bad-updates", "2",
                 "--exp-name", "nan", "--num-steps", "5", *TINY[2:], tmp_path=tmp_path)
    assert p.returncode != 0
    assert "2 consecutive non-finite updates" in p.stderr and "lower --lr" in p.stderr
    rows = [json.loads(l) for l in open(tmp_path / "nan" / "metrics.jsonl")]
    assert rows[0]["step"] == 0 and rows[0]["train/skipped_updates"] == 1


def test_engine_logprobs_every_k_steps(tiny_model_dir, tmp_path):
    """--engine-logprobs-every k: the engine returns log-probs (and the gap metrics appear) at steps 0, k, 2k...;
    0: never. Training is the same either way (seeded samples, the update does not use them without --tis-cap)."""
    steps = ["--num-steps", "3", *TINY[2:]]
    for name, k in (("every2", "2"), ("never", "0")):
        run_grpo("--model", str(tiny_model_dir), *steps, "--exp-name", name, "--engine-logprobs-every", k,
                 tmp_path=tmp_path, check=True)
    rows = {name: [json.loads(l) for l in open(tmp_path / name / "metrics.jsonl")] for name in ("every2", "never")}
    assert ["rollout/logprob_gap_mean" in r for r in rows["every2"]] == [True, False, True]
    assert not any("rollout/logprob_gap_mean" in r for r in rows["never"])
    assert [r["train/loss"] for r in rows["never"]] == [r["train/loss"] for r in rows["every2"]]
