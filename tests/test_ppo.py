"""ppo.py: GAE, token rewards, value clipping, the adaptive KL controller and split invariance on hand-computed
cases; a 2-rank CPU run and a learning run on a toy reward (both @slow)."""
import json
import math
from pathlib import Path

import pytest
import torch

from ppo import (Args, aggregate_loss, clipped_value_loss, explained_variance, gae, loss_normaliser, masked_whiten,
                 token_rewards, update_kl_coef)


def letters(prompt: str, completion: str, answer: str) -> float:
    """Toy reward: the fraction of ASCII letters in the completion (tests/toy_reward.py:letters, kept here so
    this file stands alone)."""
    return sum(c.isascii() and c.isalpha() for c in completion) / max(1, len(completion))


def test_gae_hand_computed_bootstrap_and_terminal():
    g, lam = 0.9, 0.8  # gamma * lambda = 0.72
    # row 0: 3 tokens, truncated, bootstrapped with V(s_T) = 2; row 1: 2 tokens, terminal (V(s_T) = 0).
    # Entries past each row's end (5.0, 9.0) must not leak in.
    rewards = torch.tensor([[0.1, -0.1, 0.0, 5.0], [0.0, 1.0, 5.0, 5.0]])
    values = torch.tensor([[0.5, 1.0, 1.5, 9.0], [0.2, 0.4, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    adv, ret = gae(rewards, values, mask, torch.tensor([2.0, 0.0]), g, lam)
    # row 0: delta_2 = 0 + .9*2 - 1.5 = .3; delta_1 = -.1 + .9*1.5 - 1 = .25; delta_0 = .1 + .9*1 - .5 = .5
    #        A_2 = .3, A_1 = .25 + .72*.3 = .466, A_0 = .5 + .72*.466 = .83552
    # row 1: delta_1 = 1 - .4 = .6; delta_0 = 0 + .9*.4 - .2 = .16; A_1 = .6, A_0 = .16 + .72*.6 = .592
    torch.testing.assert_close(adv, torch.tensor([[0.83552, 0.466, 0.3, 0], [0.592, 0.6, 0, 0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.33552, 1.466, 1.8, 0], [0.792, 1.0, 0, 0]]))
    # the same truncated row treated as terminal: only the last delta changes by -gamma * V(s_T)
    adv_t, _ = gae(rewards, values, mask, torch.zeros(2), g, lam)
    torch.testing.assert_close(adv - adv_t, torch.tensor([[1.8 * 0.72 ** 2, 1.8 * 0.72, 1.8, 0], [0, 0, 0, 0]]))


def test_gae_lambda_one_gamma_one_is_reward_to_go_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.3, 0.6, 0.9]])
    adv, ret = gae(rewards, values, torch.ones(1, 3), torch.zeros(1), 1.0, 1.0)
    torch.testing.assert_close(ret, torch.ones(1, 3))
    torch.testing.assert_close(adv, 1 - values)


def test_token_rewards_kl_per_token_and_task_at_last_token():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    ref_logp = torch.tensor([[-1.5, -1.8, -3.1], [-1.0, -2.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    r = token_rewards(torch.tensor([1.0, 2.0]), logp, ref_logp, mask, 0.1, torch.tensor([True, False]))
    # row 0: -0.1 * (0.5, -0.2, 0.1), + 1 at the last token; row 1: one token, KL 0, its task reward dropped
    torch.testing.assert_close(r, torch.tensor([[-0.05, 0.02, 0.99], [0.0, 0, 0]]))
    r = token_rewards(torch.tensor([1.0, 2.0]), logp, None, mask, 0.1, torch.tensor([True, True]))
    torch.testing.assert_close(r, torch.tensor([[0.0, 0, 1], [2, 0, 0]]))


@pytest.mark.parametrize("v, expected_loss, expected_clipped", [
    (1.5, 0.5 * 0.8 ** 2, True),    # moved past old + 0.2 towards the return: the clipped error (0.8) is larger
    (1.1, 0.5 * 0.9 ** 2, False),   # inside the clip range: both errors equal
    (0.5, 0.5 * 1.5 ** 2, False),   # moved away from the return: the unclipped error is larger
])
def test_clipped_value_loss_cases(v, expected_loss, expected_clipped):
    values = torch.tensor([[v]], requires_grad=True)
    loss, clipped = clipped_value_loss(values, torch.tensor([[1.0]]), torch.tensor([[2.0]]), vf_clip=0.2)
    assert loss.item() == pytest.approx(expected_loss)
    assert clipped.item() == expected_clipped
    loss.sum().backward()
    assert (values.grad.item() == 0) == expected_clipped  # the clipped branch carries no gradient


def test_clipped_value_loss_off():
    loss, clipped = clipped_value_loss(torch.tensor([[1.5]]), torch.tensor([[1.0]]), torch.tensor([[2.0]]), 0.0)
    assert loss.item() == pytest.approx(0.125) and not clipped.any()


def test_adaptive_kl_controller_hand_computed():
    # KL 9 vs target 6: error 0.5 clipped to 0.2; 64 sequences over a 10000 horizon -> x (1 + 0.2 * 0.0064)
    assert update_kl_coef(0.1, 9.0, 6.0, 10000, 64) == pytest.approx(0.100128)
    # KL 5.4: error -0.1 -> x (1 - 0.1 * 0.0064)
    assert update_kl_coef(0.1, 5.4, 6.0, 10000, 64) == pytest.approx(0.099936)
    assert update_kl_coef(0.1, 100.0, 0.0, 10000, 64) == 0.1  # target 0: fixed coefficient
    coef = 0.1
    for _ in range(100):  # KL stays too high: the coefficient keeps rising, by at most 0.2 * n / horizon a step
        coef = update_kl_coef(coef, 50.0, 6.0, 1000, 100)
    assert coef == pytest.approx(0.1 * 1.02 ** 100)


def test_masked_whiten_and_explained_variance():
    torch.manual_seed(0)
    x = torch.randn(4, 6) * 3 + 2
    mask = torch.tensor([[1.0] * 6, [1] * 3 + [0] * 3, [1] * 5 + [0], [1] + [0] * 5])
    w = masked_whiten(x, mask)
    sel = w[mask.bool()]
    assert sel.mean().item() == pytest.approx(0, abs=1e-5)
    assert sel.pow(2).mean().item() == pytest.approx(1, abs=1e-4)
    assert (w[~mask.bool()] == 0).all()
    assert explained_variance(x, x, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(x, 7.0), x, mask) == pytest.approx(0.0, abs=1e-5)
    assert explained_variance(x, torch.zeros_like(x), mask) == 0.0  # constant returns: defined as 0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_losses_split_invariant(mode):
    """The policy and value losses summed over micro-batches / ranks equal the loss of the whole mini-batch."""
    torch.manual_seed(1)
    B, T = 6, 5
    mask = (torch.arange(T)[None] < torch.tensor([5, 1, 3, 4, 2, 5])[:, None]).float()
    pg_tok = torch.randn(B, T)
    vf_tok, _ = clipped_value_loss(torch.randn(B, T), torch.randn(B, T), torch.randn(B, T), 0.2)
    norm = loss_normaliser(mask, mode, max_new_tokens=T)
    for tok in (pg_tok, vf_tok):
        whole = aggregate_loss(tok, mask, mode, norm)
        parts = sum(aggregate_loss(tok[r], mask[r], mode, norm) for r in ([0, 1], [2, 3, 4], [5]))
        torch.testing.assert_close(parts, whole)


def test_derived_geometry():
    a = Args(prompts_per_step=64, samples_per_prompt=2, num_minibatches=4, num_epochs=2)
    assert (a.sequences_per_step, a.sequences_per_minibatch, a.optimizer_steps_per_rollout) == (128, 32, 8)


# ---- end to end --------------------------------------------------------------------------------------------
def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_ranks_end_to_end(tiny_model_dir, tmp_path):
    from conftest import torchrun  # not at the top: the workers import this file for a_to_m()
    run = lambda name, *extra: torchrun(
        "ppo.py", "--model", str(tiny_model_dir), "--out-dir", str(tmp_path), "--exp-name", name,
        "--reward-fn", "tests.test_ppo:letters", "--num-steps", "2", "--max-new-tokens", "8",
        "--prompts-per-step", "4", "--num-minibatches", "2", "--num-epochs", "1", "--eval-every", "0",
        "--kl-target", "6", "--critic-warmup-steps", "1", "--bootstrap-truncated", "--no-chat-template",
        "--fsdp.keep-gathered", "on", *extra, nproc=2)
    run("e2e")
    rows = read_metrics(tmp_path / "e2e")
    # a replicated reference, each rank scoring its own rollout before the gather, trains the same
    p = run("e2e_repl", "--reference", "replicated")
    assert "replicated, scored before the gather" in p.stdout
    for a, b in zip(rows, read_metrics(tmp_path / "e2e_repl"), strict=True):
        assert b["reward/mean"] == a["reward/mean"]
        for k in ("train/kl", "train/policy_loss", "train/value_loss", "train/kl_coef"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), k
        assert b["perf/generate_slowest_s"] >= b["perf/generate_s"]
    assert [r["step"] for r in rows] == [0, 1]
    keys = ("train/policy_loss", "train/value_loss", "train/vf_clip_frac", "train/kl_coef", "train/approx_kl",
            "train/explained_variance", "train/kl", "train/clip_frac", "train/entropy", "train/critic_grad_norm",
            "reward/mean", "rollout/response_len_mean", "perf/update_s")
    for r in rows:
        for k in keys:
            assert k in r and math.isfinite(r[k]), k
    assert rows[0]["train/optimizer_steps"] == 0 and rows[0]["train/lr"] == 0  # critic warm-up: policy waits
    assert rows[1]["train/optimizer_steps"] == 2
    assert rows[0]["train/kl_coef"] == pytest.approx(0.05)
    assert 0 < rows[1]["reward/mean"] <= 1
    assert json.loads((tmp_path / "e2e" / "config.json").read_text())["world_size"] == 2
    ckpt = sorted((tmp_path / "e2e" / "checkpoints").glob("step_*"))
    assert ckpt and ckpt[-1].name.endswith("2")  # policy, critic, both optimisers and schedules, kl_coef


def a_to_m(prompt: str, completion: str, answer: str) -> float:
    """Toy reward: the fraction of letters a-m in the completion (tests/toy_reward.py:a_to_m, kept here so this file
    stands alone; a random policy over SmolLM2's vocabulary starts near 0.47)."""
    return sum(c.isascii() and c.isalpha() and c.lower() <= "m" for c in completion) / max(1, len(completion))


@pytest.mark.slow
def test_learns_toy_reward(tiny_model_dir, tmp_path):
    """A random 2-layer model learns to emit tokens made of the letters a-m: the mean reward of the last 3 steps beats
    the first 3 by more than 0.08. --seed 1 --deterministic on one rank with 2 threads: the same run every time on a
    machine (without --deterministic a run once rose 0.078 and failed). The rise over seeds 1-5 with these flags
    (2-core CPU, 2026-12-06): 0.108, 0.107, 0.216, 0.296, 0.154 (smallest 0.107; seed 1 has the margin 0.028)."""
    from conftest import torchrun  # not at the top: the workers import this file for a_to_m()
    torchrun("ppo.py", "--model", str(tiny_model_dir), "--out-dir", str(tmp_path), "--exp-name", "toy", "--seed", "1",
             "--reward-fn", "tests.test_ppo:a_to_m", "--kl-coef", "0", "--lr", "3e-2", "--critic-lr", "1e-3",
             "--num-steps", "12", "--max-new-tokens", "8", "--prompts-per-step", "16", "--num-minibatches", "2",
             "--num-epochs", "2", "--eval-every", "0", "--no-chat-template", "--instruction", "", "--deterministic",
             nproc=1, env={"OMP_NUM_THREADS": "2"})
    reward = [r["reward/mean"] for r in read_metrics(tmp_path / "toy")]
    first, last = sum(reward[:3]) / 3, sum(reward[-3:]) / 3
    assert last > first + 0.08, reward
