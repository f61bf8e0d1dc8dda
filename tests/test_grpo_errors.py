"""Bad input to grpo.py: each fails (or degrades) with a message that says what is wrong and what to change. The
one-rank command lines run through conftest.run_scripts, each as `python grpo.py ...` would."""
import json

import pytest

from conftest import run_scripts, torchrun

TINY = ["--num-steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-every", "0"]
GEOMETRY = {"minibatches": (["--num-minibatches", "3"], "--num-minibatches"),
            "microbatch": (["--max-tokens-per-microbatch", "64"], "--max-tokens-per-microbatch"),
            "temperature": (["--temperature", "0"], "--temperature 0.0"),
            "forward": (["--max-tokens-per-forward", "64"], "--max-tokens-per-forward 64"),
            "engine_logprobs": (["--engine-logprobs-every", "-1"], "--engine-logprobs-every -1")}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """Every grpo.py command line of this file, by case name: (its CompletedProcess, its --out-dir)."""
    out = tmp_path_factory.mktemp("grpo_errors")
    model = ["--model", str(tiny_model_dir)]
    missing = write_jsonl(out / "missing.jsonl", [{"problem": "1+1?", "answer": "2"}] * 4)
    verl = write_jsonl(out / "verl.jsonl", [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
                                              "reward_model": {"ground_truth": str(i + 1)}} for i in range(4)])
    long = write_jsonl(out / "long.jsonl", [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}
                                            for i in range(4)] + [{"question": "word " * 400, "answer": "#### 0"}] * 2)
    cases = {
        "missing_field": [*model, "--dataset", str(missing), *TINY],
        "verl": [*model, "--dataset", str(verl), "--prompt-field", "prompt", "--answer-field",
                 "reward_model.ground_truth", "--system-prompt", "You add one.", "--chat-template-kwargs",
                 '{"unused": true}', "--log-samples-every", "1", "--exp-name", "verl", *TINY],
        "overlong": [*model, "--dataset", str(long), "--max-prompt-tokens", "120", "--eval-fraction", "0", "--exp-name",
                     "long", *TINY],  # all rows train
        "sometimes_raises": [*model, "--reward-fn", "tests.bad_reward:sometimes_raises", "--exp-name", "raise",
                             "--temperature", "1.0", *TINY[:3], "4", *TINY[4:]],
        "always_raises": [*model, "--reward-fn", "tests.bad_reward:always_raises", *TINY],
        "reward_fn_missing": [*model, "--reward-fn", "tests.bad_reward:nope", *TINY],
        **{f"geometry_{k}": [*model, *TINY, *flags] for k, (flags, _) in GEOMETRY.items()},
        "unknown_model": ["--model", str(out / "no-such-model"), *TINY],
        "nan": [*model, "--entropy-coef", "nan", "--max-bad-updates", "2", "--exp-name", "nan", "--num-steps", "5",
                *TINY[2:]],
        **{f"engine_logprobs_{name}": [*model, "--num-steps", "3", *TINY[2:], "--exp-name", name,
                                       "--engine-logprobs-every", k] for name, k in (("every2", "2"), ("never", "0"))},
    }
    # each case in a folder of its own, as each test had its own tmp_path
    results = run_scripts({k: ["grpo.py", *v, "--out-dir", str(out / k)] for k, v in cases.items()}, out / "driver")
    return {k: (p, out / k) for k, p in results.items()}


def ok(p):
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_missing_dataset_field(runs):
    p, _ = runs["missing_field"]
    assert p.returncode != 0
    assert "question" in p.stderr and "problem" in p.stderr and "--prompt-field" in p.stderr


def test_verl_shaped_rows_with_a_system_prompt(runs):
    """A verl-style dataset (the prompt a chat, the answer at reward_model.ground_truth) trains as it is; the system
    prompt and the template variables reach the prompts the run sampled from."""
    p, tmp_path = runs["verl"]
    ok(p)
    samples = [json.loads(l) for l in open(tmp_path / "verl" / "samples.jsonl")]
    assert samples and all("You add one." in s["prompt"] and " + 1?" in s["prompt"] for s in samples), samples[0]
    assert {s["answer"] for s in samples} <= {"1", "2", "3", "4"}


def test_overlong_prompts_dropped_and_counted(runs):
    p, tmp_path = runs["overlong"]
    ok(p)
    cfg = json.loads((tmp_path / "long" / "config.json").read_text())
    assert cfg["train_prompts"] == 4 and cfg["train_prompts_dropped_too_long"] == 2
    assert "4 (2)" in p.stdout  # the geometry table shows kept (dropped)


def test_reward_function_that_raises_scores_zero_and_is_counted(runs):
    p, tmp_path = runs["sometimes_raises"]
    rows = [json.loads(l) for l in open(tmp_path / "raise" / "metrics.jsonl")]
    if p.returncode != 0:  # every sample happened to raise: that stops the run, with the sample in the message
        assert "cannot parse this completion" in p.stderr
    else:
        assert rows[0]["reward/errors"] > 0
        assert "cannot parse this completion" in p.stdout  # the first error is printed with its sample


def test_reward_function_that_always_raises_stops_the_run(runs):
    p, _ = runs["always_raises"]
    assert p.returncode != 0
    assert "KeyError" in p.stderr and "answer" in p.stderr


def test_custom_reward_fn_missing(runs):
    p, _ = runs["reward_fn_missing"]
    assert p.returncode != 0 and "nope" in p.stderr


@pytest.mark.parametrize("case", list(GEOMETRY))
def test_batch_geometry_that_does_not_divide(runs, case):
    (p, _), names = runs[f"geometry_{case}"], GEOMETRY[case][1]
    assert p.returncode != 0 and names in p.stderr


@pytest.mark.slow
def test_prompts_not_divisible_by_ranks(tiny_model_dir, tmp_path):
    p = torchrun("grpo.py", "--model", str(tiny_model_dir), *TINY[:2], "--prompts-per-step", "3", *TINY[4:],
                 "--out-dir", str(tmp_path), nproc=2, check=False)
    assert p.returncode != 0 and "--prompts-per-step 3 must be divisible" in p.stderr


def test_unknown_model_path(runs):
    p, _ = runs["unknown_model"]
    assert p.returncode != 0
    assert "no-such-model" in p.stderr and "Pass a local HF folder" in p.stderr


def test_non_finite_loss_skips_updates_then_stops(runs):
    """A NaN loss (here from --entropy-coef nan) skips the update, is logged, and stops the run after
    --max-bad-updates in a row with a message that says what to do."""
    p, tmp_path = runs["nan"]
    assert p.returncode != 0
    assert "2 consecutive non-finite updates" in p.stderr and "lower --lr" in p.stderr
    rows = [json.loads(l) for l in open(tmp_path / "nan" / "metrics.jsonl")]
    assert rows[0]["step"] == 0 and rows[0]["train/skipped_updates"] == 1


def test_engine_logprobs_every_k_steps(runs):
    """--engine-logprobs-every k: the engine returns log-probs (and the gap metrics appear) at steps 0, k, 2k...;
    0: never. Training is the same either way (seeded samples, the update does not use them without --tis-cap)."""
    rows = {}
    for name in ("every2", "never"):
        p, tmp_path = runs[f"engine_logprobs_{name}"]
        ok(p)
        rows[name] = [json.loads(l) for l in open(tmp_path / name / "metrics.jsonl")]
    assert ["rollout/logprob_gap_mean" in r for r in rows["every2"]] == [True, False, True]
    assert not any("rollout/logprob_gap_mean" in r for r in rows["never"])
    assert [r["train/loss"] for r in rows["never"]] == [r["train/loss"] for r in rows["every2"]]
