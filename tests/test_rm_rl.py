"""--reward-model in grpo.py and ppo.py end to end on CPU: an rm.py export (tiny model) scores the rollouts, mixed with
the rule reward (--rule-coef, --reward-model-coef), running-normalised (--reward-norm, state in the checkpoint, so a
resumed run loads it), with the rule reward in a worker pool (--reward-workers); reward/rm_* metrics are logged."""
import json
import math

import pytest

from conftest import run_scripts, torchrun


def rows_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, tiny_model_dir):
    """An rm.py export, then ppo.py scored by it alone (test_ppo_with_reward_model_alone)."""
    out = tmp_path_factory.mktemp("rm")
    runs = run_scripts({
        "rm": ["rm.py", "--model", str(tiny_model_dir), "--num-steps", "1", "--eval-every", "0", "--lr", "1e-3",
               "--out-dir", str(out / "runs"), "--export-hf", str(out / "hf")],
        "ppo": ["ppo.py", "--model", str(tiny_model_dir), "--reward-model", str(out / "hf"), "--rule-coef", "0",
                "--reward-fn", "tests.toy_reward:letters", "--num-steps", "2", "--max-new-tokens", "8",
                "--prompts-per-step", "4", "--eval-every", "0", "--no-chat-template", "--out-dir", str(out),
                "--exp-name", "ppo_rm"]}, out / "driver")
    for p in runs.values():
        assert p.returncode == 0, p.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def rm_export(one_rank):
    return one_rank / "hf"


@pytest.mark.slow
def test_grpo_with_reward_model(tiny_model_dir, rm_export, tmp_path):
    args = ["grpo.py", "--model", str(tiny_model_dir), "--reward-model", str(rm_export), "--rule-coef", "0.5",
            "--reward-norm", "--reward-workers", "2", "--reward-fn", "tests.toy_reward:letters", "--prompts-per-step",
            "4", "--group-size", "2", "--max-new-tokens", "8", "--eval-every", "0", "--lr", "1e-3",
            "--out-dir", str(tmp_path), "--exp-name", "grpo_rm"]
    p = torchrun(*args, "--num-steps", "2", nproc=2)
    assert "reward model" in p.stdout and "policy ids" in p.stdout  # rm.py's export shares the policy's tokenizer
    rows = rows_of(tmp_path / "grpo_rm")
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        for k in ("reward/rm_mean", "reward/rm_std", "reward/rule_mean", "perf/rm_score_s"):
            assert math.isfinite(r[k]), k
        assert r["reward/rm_std"] > 0 and 0 < r["reward/rule_mean"] <= 1  # letters() is a fraction
    # step 0: the RM score is standardised by the stats of this very batch (all ranks), so its mean is 0 and the
    # reward's mean is 0.5 x the rule reward's
    assert rows[0]["reward/mean"] == pytest.approx(0.5 * rows[0]["reward/rule_mean"], abs=1e-5)
    assert rows[1]["reward/mean"] != pytest.approx(0.5 * rows[1]["reward/rule_mean"], abs=1e-5)  # running stats
    torchrun(*args, "--num-steps", "3", "--resume", "latest", nproc=2)  # the checkpoint holds the norm's state
    assert [r["step"] for r in rows_of(tmp_path / "grpo_rm")] == [0, 1, 2]


@pytest.mark.slow
def test_ppo_with_reward_model_alone(one_rank):
    rows = rows_of(one_rank / "ppo_rm")  # the run: the fixture's
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:  # --rule-coef 0: the reward is the RM's score
        assert r["reward/mean"] == pytest.approx(r["reward/rm_mean"], abs=1e-5) and r["reward/rule_mean"] > 0
