"""Issue 17's defects in the algorithm scripts' pure functions and their start-up checks (grpo.py, ppo.py, dpo.py):
each test failed before its fix."""
import math
import os
import subprocess
import sys

import pytest
import torch

import dpo
import grpo
import ppo
from common.dist import Dist
from conftest import ROOT

SCRIPTS = (grpo, ppo)


# ---- 1. a group of one ----------------------------------------------------------------------------------------
def test_group_of_one_has_zero_advantage_not_nan():
    adv = grpo.group_advantages(torch.tensor([1.0, 0.0, 3.0]), group_size=1, scale_by_std=True)
    assert torch.equal(adv, torch.zeros(3))


# ---- 4. an engine log-prob of exactly 0.0 is a log-prob ----------------------------------------------------------
def test_engine_logprob_zero_counts_in_gap_and_tis():
    """A token the engine sampled with probability 1 has log-prob 0.0: it is in the gap metric and gets the TIS
    weight min(pi_old / pi_engine, cap), not the weight 1 of a token without an engine log-prob."""
    args = grpo.Args(tis_cap=10.0)
    mask = torch.ones(1, 2)
    old = torch.tensor([[math.log(0.5), math.log(0.25)]])
    engine = torch.tensor([[0.0, math.log(0.5)]])  # token 0: probability 1 in the engine
    _, stats = grpo.policy_loss(old.clone(), torch.zeros(1, 2), mask, torch.ones(1), old, None, engine, args, 2.0)
    assert stats["gap_sum"].item() == pytest.approx(math.log(2) + math.log(2))
    assert stats["tis_w"].item() == pytest.approx(0.5 + 0.5)
    # the explicit mask: a token without an engine log-prob is out of the gap and weighs 1
    _, stats = grpo.policy_loss(old.clone(), torch.zeros(1, 2), mask, torch.ones(1), old, None, engine, args, 2.0,
                                engine_mask=torch.tensor([[False, True]]))
    assert stats["gap_sum"].item() == pytest.approx(math.log(2))
    assert stats["tis_w"].item() == pytest.approx(1.0 + 0.5)


# ---- 5. --overlong mask: masked sequences leave the seq-mean denominators ------------------------------------------
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_fully_masked_sequences_leave_seq_mean_denominators(script):
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])  # row 1: truncated, masked out
    loss_tok = torch.tensor([[1.0, 3.0, 9.0], [5.0, 5.0, 5.0], [4.0, 9.0, 9.0]])
    n = script.loss_normaliser(mask, "seq-mean-token-mean", 3)
    assert n == 2.0
    assert script.aggregate_loss(loss_tok, mask, "seq-mean-token-mean", n).item() == pytest.approx((2.0 + 4.0) / 2)
    n = script.loss_normaliser(mask, "seq-mean-token-sum", 3)
    assert n == 2 * 3
    assert script.aggregate_loss(loss_tok, mask, "seq-mean-token-sum", n).item() == pytest.approx(8.0 / 6)
    # the same loss as without the masked sequence at all
    keep = [0, 2]
    for agg in ("seq-mean-token-mean", "seq-mean-token-sum", "token-mean"):
        assert script.loss_normaliser(mask, agg, 3) == script.loss_normaliser(mask[keep], agg, 3)


# ---- 6. ppo.py: approx_kl and the value-clip fraction -------------------------------------------------------
def test_ppo_approx_kl_is_k3_of_kl_old_to_new():
    """Samples come from pi_old: k3 of KL(pi_old || pi) is r - 1 - log r with r = pi / pi_old."""
    logp, old = torch.tensor([math.log(0.25)]), torch.tensor([math.log(0.5)])
    r = 0.25 / 0.5
    assert ppo.approx_kl(logp, old).item() == pytest.approx(r - 1 - math.log(r))  # 0.193; swapped: 0.307
    # unbiased under pi_old: E_old[r - 1 - log r] = KL(pi_old || pi), checked on a 3-token distribution
    p_old, p = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    expected = (p_old * (p_old / p).log()).sum()
    assert (p_old * ppo.approx_kl(p.log(), p_old.log())).sum().item() == pytest.approx(expected.item())


def test_ppo_value_clip_fraction_ignores_rounding_inside_the_range():
    # |v - old| = 0.178 < vf_clip, but old + (v - old) != v in float32 and its error came out the larger
    old, v, ret = (torch.tensor([x]) for x in (0.1331416815519333, -0.04479163512587547, 1.1788735389709473))
    loss, clipped = ppo.clipped_value_loss(v, old, ret, 0.2)
    assert not clipped.any()
    assert loss.item() == 0.5 * ((v - ret) ** 2).item()
    # outside the range and the clipped error larger: clipped
    loss, clipped = ppo.clipped_value_loss(torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([2.0]), 0.2)
    assert clipped.all() and loss.item() == pytest.approx(0.5 * 1.8 ** 2)
    # outside the range but the unclipped error larger: not clipped
    _, clipped = ppo.clipped_value_loss(torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([0.0]), 0.2)
    assert not clipped.any()


# ---- 7. unknown names raise ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_unknown_kl_estimator_and_loss_agg_raise(script):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="'k4'.*k1, k2 or k3"):
        script.kl_penalty(x, x, "k4")
    with pytest.raises(ValueError, match="'seq-mean'.*--loss-agg"):
        script.loss_normaliser(torch.ones(1, 2), "seq-mean", 2)
    with pytest.raises(ValueError, match="'seq-mean'.*--loss-agg"):
        script.aggregate_loss(x, torch.ones(1, 2), "seq-mean", 1.0)


# ---- 12. sizes (and 1, 7) checked at start-up, before the model loads ----------------------------------------------
@pytest.fixture
def no_model(monkeypatch):
    """main() without a process group, failing loudly if it gets as far as loading a model."""
    def model_loaded(*a, **k):
        raise AssertionError("the model was loaded before the bad flag was reported")
    for script in (grpo, ppo, dpo):
        monkeypatch.setattr(script.D, "init_distributed", lambda device="auto": Dist(0, 1, 0, torch.device("cpu")))
        # grpo.py / ppo.py resolve --model through common.rl_setup.resolve_model_once (rank 0 first)
        monkeypatch.setattr(script, "resolve_model_once" if hasattr(script, "resolve_model_once") else "resolve_model",
                            model_loaded)
        monkeypatch.setattr(script.D, "seed_everything", lambda seed: None)
    import common.lifecycle
    # grpo.py, ppo.py and dpo.py start through common.lifecycle.start_run
    monkeypatch.setattr(common.lifecycle, "set_deterministic", lambda flag: None)


BAD = [(grpo, dict(max_new_tokens=0), "--max-new-tokens 0: must be >= 1"),
       (grpo, dict(prompts_per_step=-2), "--prompts-per-step -2"),
       (grpo, dict(group_size=0), "--group-size 0"),
       (grpo, dict(group_size=1), "--group-size 1: .*--scale-by-std"),
       (grpo, dict(eval_size=-1), "--eval-size -1"),
       (grpo, dict(num_steps=-1), "--num-steps -1"),
       (grpo, dict(num_minibatches=0), "--num-minibatches 0"),
       (grpo, dict(max_tokens_per_microbatch=-1), "--max-tokens-per-microbatch -1"),  # 0 is auto
       (grpo, dict(lr=-1e-6), "--lr -1e-06"),
       (grpo, dict(lr=float("nan")), "--lr nan"),
       (grpo, dict(kl_estimator="k4"), "--kl-estimator 'k4'"),
       (grpo, dict(loss_agg="seq-mean"), "--loss-agg 'seq-mean'"),
       (ppo, dict(max_new_tokens=0), "--max-new-tokens 0"),
       (ppo, dict(samples_per_prompt=0), "--samples-per-prompt 0"),
       (ppo, dict(num_epochs=0), "--num-epochs 0"),
       (ppo, dict(critic_lr=-1.0), "--critic-lr -1.0"),
       (ppo, dict(loss_agg="seq-mean"), "--loss-agg 'seq-mean'"),
       (dpo, dict(pairs_per_step=0), "--pairs-per-step 0"),
       (dpo, dict(max_length=0), "--max-length 0"),
       (dpo, dict(lr=-1.0), "--lr -1.0"),
       (dpo, dict(eval_size=-1), "--eval-size -1")]


@pytest.mark.parametrize("script,flags,message", BAD, ids=[f"{s.__name__}-{'-'.join(f)}" for s, f, _ in BAD])
def test_bad_sizes_rejected_before_the_model_loads(no_model, script, flags, message):
    with pytest.raises(ValueError, match=message):
        script.main(script.Args(**flags))


def test_cli_max_new_tokens_zero_named_before_model(tmp_path):
    """From the command line: the flag is named, and the (missing) model is never looked at."""
    p = subprocess.run([sys.executable, "grpo.py", "--max-new-tokens", "0", "--model", str(tmp_path / "no-such-model"),
                        "--out-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"})
    assert p.returncode != 0
    assert "--max-new-tokens 0: must be >= 1" in p.stderr and "no-such-model" not in p.stderr


# ---- a CUDA MPS share of the SMs (wrong results on an H200, 2026-12-03 and 12-04) ---------------------------------
def test_start_run_warns_under_an_mps_sm_share(monkeypatch, recwarn):
    import common.lifecycle as L
    monkeypatch.setattr(L.D, "init_distributed",  # "auto" resolves to the GPU, as on a GPU machine
                        lambda device: Dist(0, 1, 0, torch.device("cpu" if device == "cpu" else "cuda")))
    monkeypatch.setattr(L, "set_deterministic", lambda flag: None)
    mps = lambda: [w for w in recwarn if "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in str(w.message)]
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    L.start_run("cuda", False, 0)
    assert not mps()  # no share: no warning
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "70")
    L.start_run("cpu", False, 0)
    assert not mps()  # the share does not touch a CPU run
    L.start_run("auto", False, 0)
    assert len(mps()) == 1 and "=70" in str(mps()[0].message) and "grad_norm" in str(mps()[0].message)
