"""Issue 57's runtime faults (items 4, 5, 7, 8, 9, 10): user errors printed once without a traceback, damaged
checkpoints skipped by name, --num-steps 0 as an evaluation, each resumed segment's config kept, a Slurm-style
SIGTERM to the launchers ending in 143, and the importance ratio bounded. Each test failed before its fix."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import grpo
import grpo_async
import ppo
from common.models import TokenLoss
from conftest import ROOT

ENV = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "TORCHELASTIC_RUN_ID")},
       "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled",
       "HF_HUB_OFFLINE": "1"}


# ---- 10. the importance ratio is formed from a bounded log-ratio ----------------------------------------------------
@pytest.mark.parametrize("script", [grpo, ppo, grpo_async], ids=["grpo", "ppo", "grpo_async"])
@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
@pytest.mark.parametrize("dual_clip_c", [0.0, 3.0])
def test_clipped_pg_loss_finite_at_extreme_log_ratios(script, log_ratio, dual_clip_c):
    """exp(100) overflows float32: an infinite loss, and with dual-clip a NaN gradient (inf * 0), before the clamp."""
    old_logp = torch.full((2, 3), -2.0)
    logp = (old_logp + log_ratio).requires_grad_()
    adv = torch.tensor([1.0, -1.0])  # both signs: the min picks the unclipped branch for one of them
    loss, _ = script.clipped_pg_loss(logp, old_logp, adv, 0.2, 0.2, dual_clip_c)
    loss.sum().backward()
    assert torch.isfinite(loss).all(), loss
    assert torch.isfinite(logp.grad).all(), logp.grad


def extreme_batch(log_ratio: float):
    """(B, T) = (2, 4) log-probs whose ratio to old_logp, to the engine's and to the reference's is exp(+-log_ratio)."""
    old_logp = torch.full((2, 4), -3.0)
    logp = (old_logp + log_ratio).requires_grad_()
    engine_logp = old_logp - log_ratio  # TIS: exp(old - engine) = exp(log_ratio)
    ref_logp = old_logp - log_ratio  # k3: exp(-(logp - ref)) = exp(-2 log_ratio)
    mask = torch.ones(2, 4)
    return logp, old_logp, engine_logp, ref_logp, mask, torch.tensor([1.0, -1.0])


@pytest.mark.parametrize("script", [grpo, grpo_async], ids=["grpo", "grpo_async"])
@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_grpo_policy_loss_finite_at_extreme_log_ratios(script, log_ratio, ratio_level):
    """The whole per-token loss: the ratio (GSPO's sequence ratio too), the TIS weight and the k3 KL, with dual-clip."""
    logp, old_logp, engine_logp, ref_logp, mask, adv = extreme_batch(log_ratio)
    args = script.Args(dual_clip_c=3.0, tis_cap=2.0, kl_coef=0.1, kl_estimator="k3", ratio_level=ratio_level)
    loss, stats = script.policy_loss(logp, torch.zeros_like(logp), mask, adv, old_logp, ref_logp, engine_logp, args,
                                     float(mask.sum()))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), (loss, logp.grad)
    assert all(torch.isfinite(v).all() for v in stats.values()), stats


@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
def test_ppo_token_loss_finite_at_extreme_log_ratios(log_ratio):
    logp, old_logp, engine_logp, ref_logp, mask, adv = extreme_batch(log_ratio)
    args = ppo.Args(dual_clip_c=3.0, tis_cap=2.0)
    loss_tok, _, w = ppo.token_pg_loss(logp, torch.zeros_like(logp), adv[:, None].expand(2, 4), old_logp,
                                       engine_logp, torch.ones(2, 4, dtype=torch.bool), args)
    loss_tok.sum().backward()
    assert torch.isfinite(loss_tok).all() and torch.isfinite(w).all() and torch.isfinite(logp.grad).all()
    kl = ppo.approx_kl(logp.detach(), old_logp) + ppo.kl_penalty(logp.detach(), ref_logp, "k3")
    assert torch.isfinite(kl).all()


@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
def test_fused_token_loss_finite_at_extreme_log_ratios(log_ratio):
    """The fused path (kernels.token_loss, which grpo.learn_minibatch uses with --fused-loss) calls grpo.py's
    token_policy_loss on the kernel's log-probs: finite loss and gradients there too (Triton's interpreter on CPU)."""
    import kernels.logprob as lp
    if not lp.HAS_TRITON:
        pytest.fail("triton is in requirements.txt: the fused path must be testable")
    torch.manual_seed(0)
    N, H, V = 8, 16, 40
    hidden, weight = torch.randn(N, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    tgt = torch.randint(0, V, (N,))
    with torch.no_grad():
        logp0, _ = lp.token_logprobs(hidden, weight, tgt, 1.0, impl="torch")
    old_logp = logp0 - log_ratio  # ratio exp(log_ratio) at every token
    args = grpo.Args(dual_clip_c=3.0, tis_cap=2.0, kl_coef=0.1, kl_estimator="k3")
    adv = torch.tensor([1.0, -1.0]).repeat(N // 2)

    # as grpo.learn_minibatch builds it: TokenLoss(token_policy_loss, weight, adv, old, ref, engine, has_engine)
    tl = TokenLoss(lambda *x: grpo.token_policy_loss(*x, args)[0], torch.ones(N), adv, old_logp, old_logp,
                   old_logp + log_ratio, torch.ones(N, dtype=torch.bool))
    loss, _, _ = lp.token_loss(hidden, weight, tgt, tl.fn, tl.token_args, 1.0, impl="fused")
    loss.backward()
    assert torch.isfinite(loss), loss
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
