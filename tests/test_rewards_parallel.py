"""common/rewards.py at scale: the worker pool (--reward-workers) against serial scoring, its per-sample timeouts and
error accounting, @batched reward functions, and RunningNorm (--reward-norm)."""
import json
import math
import os
from pathlib import Path

import pytest
import torch

from common.rewards import RunningNorm, load_reward_fn, score, with_workers
from tests import slow_reward

GSM8K = Path(__file__).resolve().parent / "data" / "gsm8k" / "test.jsonl"


def gsm8k_samples(n: int) -> tuple[list[str], list[str], list[str]]:
    """n (prompt, completion, answer) from the GSM8K test rows with synthesised completions: right, wrong, boxed,
    thousands commas, and no answer."""
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    prompts, completions, answers = [], [], []
    for i in range(n):
        row = rows[i % len(rows)]
        gold = row["answer"].rsplit("####", 1)[1].strip()
        completions.append([f"Step by step.\n#### {gold}", f"#### {int(gold.replace(',', '')) + 1}",
                            f"so \\boxed{{{gold}}}", "I am not sure.", f"The answer is {gold}."][i % 5])
        prompts.append(row["question"])
        answers.append(row["answer"])
    return prompts, completions, answers


@pytest.fixture(scope="module")
def pooled():
    fn = with_workers(slow_reward.sleepy, 2)
    yield fn
    fn.close()


def test_pool_gives_the_serial_rewards(pooled):
    p, c, a = gsm8k_samples(100)
    serial = score(slow_reward.sleepy, p, c, a, timeout_s=5)
    parallel = score(pooled, p, c, a, timeout_s=5)
    assert parallel.rewards == serial.rewards
    assert 0 < sum(serial.rewards) < len(serial.rewards)  # some right, some wrong
    assert (parallel.n_errors, parallel.n_timeouts) == (serial.n_errors, serial.n_timeouts) == (0, 0)


def test_pool_keeps_timeouts_and_errors_per_sample(pooled):
    p, c, a = gsm8k_samples(12)
    c[3], c[7], c[8], c[10] = "hang", "boom", "nan", "hang too"
    serial = score(slow_reward.sleepy, p, c, a, timeout_s=0.5)
    parallel = score(pooled, p, c, a, timeout_s=0.5)
    assert (parallel.n_timeouts, parallel.n_errors) == (serial.n_timeouts, serial.n_errors) == (2, 2)
    assert parallel.rewards == serial.rewards and parallel.rewards[3] == parallel.rewards[7] == 0.0
    assert parallel.first_error == serial.first_error and "sample 3: timed out after 0.5 s" in parallel.first_error
    p1 = score(pooled, p[:1], ["fine #### 1"], a[:1], timeout_s=0.5)  # the workers survive a timed-out sample
    assert p1.n_timeouts == 0 and p1.n_errors == 0


def test_pool_runs_in_other_processes():
    fn = with_workers(slow_reward.worker_pid, 2)
    try:
        pids = set(score(fn, ["p"] * 64, ["c"] * 64, ["a"] * 64).rewards)
    finally:
        fn.close()
    assert os.getpid() not in pids and 1 <= len(pids) <= 2


def test_pool_all_failed_still_raises(pooled):
    with pytest.raises(RuntimeError, match="every one of the 2 samples failed.*boom"):
        score(pooled, ["p", "q"], ["boom", "boom!"], ["1", "2"], timeout_s=5)


def test_with_workers_refuses_what_it_cannot_run():
    assert with_workers(slow_reward.sleepy, 0) is slow_reward.sleepy
    with pytest.raises(ValueError, match="module-level def"):
        with_workers(lambda p, c, a: 1.0, 2)
    with pytest.raises(ValueError, match="per-sample reward functions.*@batched"):
        with_workers(slow_reward.lengths, 2)
    with pytest.raises(ValueError, match=">= 0"):
        with_workers(slow_reward.sleepy, -1)


def test_batched_function():
    fn = load_reward_fn("tests.slow_reward:lengths")
    assert fn.batched
    res = score(fn, ["p"] * 3, ["ab", "bad", "abcd"], ["a"] * 3)
    assert res.rewards == [2.0, 0.0, 4.0] and res.n_errors == 1 and "sample 1: returned str" in res.first_error
    assert score(fn, [], [], []).rewards == []
    with pytest.raises(ValueError, match="returned 1 values for 2 samples"):
        score(slow_reward.wrong_count, ["p"] * 2, ["c"] * 2, ["a"] * 2)
    with pytest.raises(RuntimeError, match="every one of the 2 samples failed.*batched call timed out after 0.4 s"):
        score(slow_reward.slow_batch, ["p"] * 2, ["c"] * 2, ["a"] * 2, timeout_s=0.2)  # 0.2 s x 2 samples


def test_running_norm_matches_the_whole_stream():
    torch.manual_seed(0)
    x = torch.randn(300, dtype=torch.float64) * 3 + 5
    norm = RunningNorm()
    for chunk in x.split(37):
        norm.update(len(chunk), float(chunk.mean()), float(((chunk - chunk.mean()) ** 2).sum()))
    assert norm.n == 300 and norm.mean == pytest.approx(float(x.mean()), abs=1e-9)
    assert norm.std == pytest.approx(float(x.std(unbiased=False)), abs=1e-9)
    z = norm.normalize(x)
    assert float(z.mean()) == pytest.approx(0.0, abs=1e-6) and float(z.std(unbiased=False)) == pytest.approx(1.0, abs=1e-5)
    again = RunningNorm()
    again.load_state_dict(json.loads(json.dumps(norm.state_dict())))  # as the checkpoint's extra.json keeps it
    assert again.state_dict() == norm.state_dict()
    assert RunningNorm().normalize(2.0) == pytest.approx(2.0, rel=1e-5) and not math.isnan(RunningNorm().std)
