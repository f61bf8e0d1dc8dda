"""Issue 25's objectives as flags of grpo.py / ppo.py, each on a hand-computed case through the scripts' own functions:
GSPO (--ratio-level sequence), RLOO and REINFORCE++ (--adv-estimator), dual-clip PPO (--dual-clip-c), the KL
estimators k1+ / k3+ / abs, the KL in the reward (--kl-in-reward) and the adaptive controller (--kl-target), DAPO's
soft overlong penalty and re-sampling rounds, and the loss aggregation names (docs/grpo.md has the formulas)."""
import json
import math

import pytest
import torch

import grpo
import ppo
from common.dist import Dist
from common.rl_setup import check_geometry

SCRIPTS = (grpo, ppo)


# ---- GSPO: the sequence-level ratio ---------------------------------------------------------------------------
def gspo_case(ratio_level: str, adv: float):
    """One sequence of two tokens with ratios 2.25 and 1 (geometric mean 1.5) and a masked third token whose ratio
    (e^5) must not count; token-mean over the two tokens."""
    old = torch.zeros(1, 3)
    logp = torch.tensor([[math.log(2.25), 0.0, 5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    args = grpo.Args(ratio_level=ratio_level)
    loss, stats = grpo.policy_loss(logp, torch.zeros(1, 3), mask, torch.tensor([adv]), old, None, torch.zeros(1, 3),
                                   args, 2.0)
    loss.backward()
    return loss.item(), logp.grad[0].tolist(), stats


def test_gspo_sequence_ratio_is_the_geometric_mean_clipped_per_sequence():
    # A = -1: s = 1.5 > 1 - eps, the pessimistic branch is s A: every token's loss is 1.5, its gradient s (-A) / 2
    loss, grad, stats = gspo_case("sequence", -1.0)
    assert loss == pytest.approx(1.5)
    assert grad == pytest.approx([0.75, 0.75, 0.0])  # GSPO-token: s_i A_i grad log pi_t, for each token alike
    assert stats["clip_frac"].item() == 0
    # A = +1: s = 1.5 is clipped at 1.2 for the whole sequence: loss -1.2, no gradient, both tokens clipped
    loss, grad, stats = gspo_case("sequence", 1.0)
    assert loss == pytest.approx(-1.2)
    assert grad == [0.0, 0.0, 0.0]
    assert stats["clip_frac"].item() == 2
    # per token (the default): ratio 2.25 clipped at 1.2, ratio 1 not: (-1.2 - 1) / 2, gradient only on token 2
    loss, grad, _ = gspo_case("token", 1.0)
    assert loss == pytest.approx(-1.1)
    assert grad == pytest.approx([0.0, -0.5, 0.0])


def test_gspo_old_logp_value_and_gradient():
    logp = torch.tensor([[math.log(2.0), math.log(0.5), 0.3]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    o = grpo.sequence_ratio_old_logp(logp, torch.zeros(1, 3), mask)
    ratio = torch.exp(logp - o)
    assert ratio[0, :2].tolist() == pytest.approx([1.0, 1.0])  # geometric mean of 2 and 0.5
    ratio[0, 0].backward()
    assert logp.grad[0].tolist() == pytest.approx([1.0, 0.0, 0.0])  # d ratio_t / d logp_t = s, nothing else


# ---- advantage estimators -------------------------------------------------------------------------------------
def adv_of(estimator, rewards, mask, kl_reward=None, group_size=4, scale_by_std=True):
    kl_reward = torch.zeros_like(mask) if kl_reward is None else kl_reward
    return grpo.advantages(torch.tensor(rewards), kl_reward, mask, group_size, estimator, scale_by_std, 0.0)


def test_rloo_leave_one_out_baseline():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    adv = adv_of("rloo", [1.0, 0.0, 0.0, 0.0], mask)
    # A_0 = 1 - mean(0, 0, 0) = 1;  A_1..3 = 0 - mean(1, 0, 0) = -1/3; --scale-by-std does not apply
    assert adv[:, 0].tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    assert adv[1, 1] == 0  # outside the mask
    assert torch.equal(adv, adv_of("rloo", [1.0, 0.0, 0.0, 0.0], mask, scale_by_std=False))


def test_grpo_estimator_unchanged_and_kl_in_the_return():
    mask = torch.ones(2, 2)
    assert adv_of("grpo", [1.0, 0.0], mask, group_size=2, scale_by_std=False)[:, 0].tolist() == [0.5, -0.5]
    # --kl-in-reward: R_i = r_i + sum_t kl_reward_t = (1 - 0.2 - 0.3, 0 - 0.1 - 0.4) = (0.5, -0.5)
    kl_reward = torch.tensor([[-0.2, -0.3], [-0.1, -0.4]])
    adv = adv_of("grpo", [1.0, 0.0], mask, kl_reward, group_size=2, scale_by_std=False)
    assert adv[:, 0].tolist() == pytest.approx([0.5, -0.5])


def test_reinforce_pp_return_to_go_whitened_over_the_batch():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    kl_reward = torch.tensor([[-0.1, -0.2], [-0.3, 0.0]])
    adv = adv_of("reinforce++", [1.0, 0.0], mask, kl_reward, group_size=2)
    # returns-to-go: row 0 (1 - 0.1 - 0.2, 1 - 0.2) = (0.7, 0.8), row 1 (0 - 0.3); mean 0.4, population variance
    dev = torch.tensor([0.3, 0.4, -0.7])
    expected = dev / math.sqrt((dev ** 2).mean().item())
    assert adv[mask.bool()].tolist() == pytest.approx(expected.tolist(), rel=1e-5)
    assert adv[1, 1] == 0


def test_reinforce_pp_baseline_group_mean_then_batch_whitening():
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    adv = adv_of("reinforce++-baseline", [1.0, 0.0, 1.0, 1.0], mask, group_size=2)
    # group means 0.5 and 1: per-sequence (0.5, -0.5, 0, 0), on the tokens (0.5, -0.5, -0.5, 0, 0); whitened
    tok = torch.tensor([0.5, -0.5, -0.5, 0.0, 0.0])
    expected = (tok - tok.mean()) / math.sqrt(((tok - tok.mean()) ** 2).mean().item())
    assert adv[mask.bool()].tolist() == pytest.approx(expected.tolist(), rel=1e-5)


def test_unknown_estimator_raises():
    with pytest.raises(ValueError, match="'gae'.*--adv-estimator"):
        adv_of("gae", [1.0, 0.0], torch.ones(2, 1), group_size=2)


# ---- dual-clip PPO (both scripts: a marked copy) ----------------------------------------------------------------
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_dual_clip_bounds_negative_advantages(script):
    ratios = torch.tensor([[0.5, 1.1, 2.0, 4.0]])
    logp = ratios.log().requires_grad_()
    # A = -1: the PPO loss max(r, clip(r)) = (0.8, 1.1, 2, 4); dual clip c = 3 caps it at -c A = 3
    loss, clipped = script.clipped_pg_loss(logp, torch.zeros(1, 4), torch.tensor([-1.0]), 0.2, 0.2, 3.0)
    assert loss[0].tolist() == pytest.approx([0.8, 1.1, 2.0, 3.0])
    assert clipped.tolist() == [[True, False, False, True]]
    loss.sum().backward()
    assert logp.grad[0, 3] == 0 and logp.grad[0, 2] == pytest.approx(2.0)
    off, _ = script.clipped_pg_loss(ratios.log(), torch.zeros(1, 4), torch.tensor([-1.0]), 0.2, 0.2)
    assert off[0].tolist() == pytest.approx([0.8, 1.1, 2.0, 4.0])
    # A > 0: unchanged by the dual clip; per-token advantages (B, T) as ppo.py passes them
    pos, _ = script.clipped_pg_loss(ratios.log(), torch.zeros(1, 4), torch.tensor([[1.0, 1.0, 1.0, -1.0]]), 0.2, 0.2,
                                    3.0)
    assert pos[0].tolist() == pytest.approx([-0.5, -1.1, -1.2, 3.0])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_dual_clip_c_must_exceed_one(script):
    with pytest.raises(ValueError, match="--dual-clip-c 0.5"):
        check_geometry(script.Args(dual_clip_c=0.5, prompts_per_step=8), 1)
    check_geometry(script.Args(dual_clip_c=3.0, prompts_per_step=8), 1)


# ---- KL estimators -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("estimator,value", [("k1+", math.log(2)), ("k3+", 0.5 - 1 + math.log(2)),
                                             ("abs", math.log(2))])
def test_straight_through_and_abs_estimators(estimator, value):
    logp = torch.tensor([math.log(0.5)], requires_grad=True)
    ref = torch.tensor([math.log(0.25)])  # log pi/pi_ref = log 2
    kl = grpo.kl_penalty(logp, ref, estimator)
    assert kl.item() == pytest.approx(value)
    kl.backward()
    # k1+, k3+: k2's gradient, log pi/pi_ref; abs: the sign of the log ratio
    assert logp.grad.item() == pytest.approx(1.0 if estimator == "abs" else math.log(2))
    neg = grpo.kl_penalty(torch.tensor([math.log(0.25)]), torch.tensor([math.log(0.5)]), estimator)
    assert neg.item() == pytest.approx({"k1+": -math.log(2), "k3+": 2 - 1 - math.log(2), "abs": math.log(2)}[estimator])


def test_adaptive_kl_controller_copy_in_grpo():
    # KL 2 vs target 1: error clipped to 0.2; 0.1 * (1 + 0.2 * 10 / 100)
    assert grpo.update_kl_coef(0.1, 2.0, 1.0, 100, 10) == pytest.approx(0.102)
    assert grpo.update_kl_coef(0.1, 0.9, 1.0, 100, 10) == pytest.approx(0.1 * (1 - 0.1 * 10 / 100))
    assert grpo.update_kl_coef(0.1, 5.0, 0.0, 100, 10) == 0.1


def test_resampling_rounds_need_dynamic_sampling():
    with pytest.raises(ValueError, match="--dynamic-sampling-max-rounds > 1 re-samples only with --dynamic-sampling"):
        check_geometry(grpo.Args(prompts_per_step=2, dynamic_sampling_max_rounds=3), 1)
    check_geometry(grpo.Args(prompts_per_step=2, dynamic_sampling_max_rounds=3, dynamic_sampling=True), 1)


def test_kl_in_reward_and_kl_target_need_a_coefficient():
    for flags in (dict(kl_in_reward=True), dict(kl_target=1.0)):
        with pytest.raises(ValueError, match="--kl-coef > 0"):
            check_geometry(grpo.Args(prompts_per_step=2, **flags), 1)
    check_geometry(grpo.Args(prompts_per_step=2, kl_coef=0.1, kl_in_reward=True, kl_target=1.0), 1)


# ---- DAPO: soft overlong penalty ---------------------------------------------------------------------------------
def test_soft_overlong_penalty_eq13():
    lengths, truncated = torch.tensor([5, 6, 8, 10]), torch.tensor([False, False, False, True])
    args = grpo.Args(max_new_tokens=10, overlong="soft", overlong_buffer=4)
    # 0 up to 10 - 4 = 6 tokens, then linear: (6 - 8) / 4 = -0.5, -1 at the maximum
    assert grpo.overlong_reward(truncated, lengths, args).tolist() == [0.0, 0.0, -0.5, -1.0]
    args = grpo.Args(max_new_tokens=10, overlong="penalty", overlong_penalty=-0.5)
    assert grpo.overlong_reward(truncated, lengths, args).tolist() == [0.0, 0.0, 0.0, -0.5]
    for mode in ("none", "mask"):
        assert grpo.overlong_reward(truncated, lengths, grpo.Args(overlong=mode)).tolist() == [0.0] * 4


def test_soft_overlong_needs_a_buffer(monkeypatch):
    monkeypatch.setattr(grpo.D, "init_distributed", lambda device="auto": Dist(0, 1, 0, torch.device("cpu")))
    monkeypatch.setattr(grpo.D, "seed_everything", lambda seed: None)
    monkeypatch.setattr(grpo, "resolve_model_once", lambda *a: (_ for _ in ()).throw(AssertionError("model loaded")))
    with pytest.raises(ValueError, match="--overlong soft needs 0 < --overlong-buffer"):
        grpo.main(grpo.Args(overlong="soft", overlong_buffer=0))


# ---- loss aggregation names ----------------------------------------------------------------------------------------
LOSS_TOK = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("mode,expected", [
    ("seq-mean-token-sum-norm", (6 + 4 + 2) / (3 * 4)),  # Dr. GRPO: token sums / max_new_tokens, mean over sequences
    ("seq-mean-token-sum", (6 + 4 + 2) / (3 * 4)),       # the old name keeps its old meaning
    ("seq-mean-token-sum-verl", (6 + 4 + 2) / 3),        # verl's seq-mean-token-sum: token sums, mean over sequences
])
def test_loss_aggregation_names(script, mode, expected):
    norm = script.loss_normaliser(MASK, mode, max_new_tokens=4)
    assert script.aggregate_loss(LOSS_TOK, MASK, mode, norm).item() == pytest.approx(expected)
    parts = [[0, 2], [1]]  # split over micro-batches, the same loss
    assert sum(script.aggregate_loss(LOSS_TOK[p], MASK[p], mode, norm) for p in parts).item() == pytest.approx(expected)


def test_old_loss_agg_name_warns(capsys):
    check_geometry(grpo.Args(loss_agg="seq-mean-token-sum", prompts_per_step=2), 1)
    out = capsys.readouterr().out
    assert "deprecated" in out and "still means seq-mean-token-sum-norm" in out and "seq-mean-token-sum-verl" in out
    check_geometry(grpo.Args(loss_agg="seq-mean-token-sum-norm", prompts_per_step=2), 1)
    assert capsys.readouterr().out == ""


# ---- the loop: every new flag at once, on CPU ---------------------------------------------------------------------
@pytest.mark.slow
def test_grpo_runs_with_the_new_objectives(tiny_model_dir, tmp_path):
    """Two steps with GSPO, REINFORCE++, dual-clip, the KL in the reward with an adaptive coefficient, DAPO's
    re-sampling rounds and soft overlong penalty, and the old --loss-agg name: the loop runs and logs them."""
    from conftest import torchrun
    p = torchrun("grpo.py", "--model", str(tiny_model_dir), "--out-dir", str(tmp_path), "--exp-name", "obj",
                 "--reward-fn", "tests.toy_reward:letters", "--num-steps", "2", "--max-new-tokens", "8",
                 "--prompts-per-step", "2", "--group-size", "4", "--eval-every", "0", "--no-chat-template",
                 "--ratio-level", "sequence", "--adv-estimator", "reinforce++", "--dual-clip-c", "3",
                 "--kl-coef", "0.05", "--kl-in-reward", "--kl-estimator", "k3+", "--kl-target", "0.001",
                 "--kl-horizon", "10", "--dynamic-sampling", "--dynamic-sampling-max-rounds", "3", "--overlong", "soft",
                 "--overlong-buffer", "4", "--loss-agg", "seq-mean-token-sum", nproc=1)
    assert "--loss-agg seq-mean-token-sum is deprecated" in p.stdout
    assert "dynamic sampling kept" in p.stdout and " rounds" in p.stdout
    rows = [json.loads(line) for line in (tmp_path / "obj" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert 1 <= r["rollout/sampling_rounds"] <= 3
        assert r["rollout/sequences_trained"] <= 8 and r["rollout/sequences_trained"] % 4 == 0
        assert math.isfinite(r["train/kl"]) and r["train/kl"] >= 0 and math.isfinite(r["train/loss"])
    # step 0: pi_old is pi_ref, KL 0, below the target: the controller lowers beta by 0.2 * n / horizon
    assert rows[0]["train/kl_coef"] == pytest.approx(0.05) and rows[0]["train/kl"] == pytest.approx(0, abs=1e-6)
    n0 = rows[0]["rollout/sequences_trained"]
    assert rows[1]["train/kl_coef"] == pytest.approx(0.05 * (1 - 0.2 * n0 / 10))
