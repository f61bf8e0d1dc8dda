"""grpo.py's pure functions on hand-computed cases, and split invariance of the loss normalisation."""
import math

import pytest
import torch

import grpo


def test_group_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = grpo.group_advantages(r, group_size=4, scale_by_std=True, eps=0.0)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std().item()  # unbiased: sqrt(1/3)
    assert torch.allclose(adv[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / std)
    # all-equal rewards give zero advantage (eps keeps it finite)
    adv = grpo.group_advantages(r, group_size=4, scale_by_std=True, eps=1e-6)
    assert torch.equal(adv[4:], torch.zeros(4))


def test_group_advantages_dr_grpo_no_std():
    r = torch.tensor([3.0, 1.0, 0.0, 0.0])
    adv = grpo.group_advantages(r, group_size=2, scale_by_std=False)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_kl_estimators_hand_computed():
    logp = torch.tensor([math.log(0.5), math.log(0.2)])
    ref = torch.tensor([math.log(0.25), math.log(0.4)])
    # log ratio log(pi/ref) = log 2, log 0.5
    k1 = grpo.kl_penalty(logp, ref, "k1")
    k2 = grpo.kl_penalty(logp, ref, "k2")
    k3 = grpo.kl_penalty(logp, ref, "k3")
    assert torch.allclose(k1, torch.tensor([math.log(2), math.log(0.5)]))
    assert torch.allclose(k2, torch.tensor([0.5 * math.log(2) ** 2, 0.5 * math.log(0.5) ** 2]))
    # k3 = ref/pi - 1 - log(ref/pi) = 0.5 - 1 + log 2 ; 2 - 1 - log 2
    assert torch.allclose(k3, torch.tensor([0.5 - 1 + math.log(2), 2 - 1 - math.log(2)]))
    assert (k3 >= 0).all()
    assert torch.equal(grpo.kl_penalty(logp, logp, "k3"), torch.zeros(2))


def test_clipped_pg_loss_clip_higher():
    old = torch.zeros(1, 4)
    ratios = torch.tensor([[0.5, 1.1, 1.25, 1.5]])
    logp = ratios.log()
    # positive advantage: clipped above at 1 + eps_high = 1.28 (clip-higher), never below
    loss, clipped = grpo.clipped_pg_loss(logp, old, torch.tensor([1.0]), 0.2, 0.28)
    assert torch.allclose(loss, -torch.tensor([[0.5, 1.1, 1.25, 1.28]]))
    assert clipped.tolist() == [[False, False, False, True]]
    # symmetric 0.2 clips 1.25 too
    loss, _ = grpo.clipped_pg_loss(logp, old, torch.tensor([1.0]), 0.2, 0.2)
    assert torch.allclose(loss, -torch.tensor([[0.5, 1.1, 1.2, 1.2]]))
    # negative advantage: clipped below at 1 - eps_low, the pessimistic max elsewhere
    loss, clipped = grpo.clipped_pg_loss(logp, old, torch.tensor([-2.0]), 0.2, 0.28)
    assert torch.allclose(loss, torch.tensor([[2 * 0.8, 2 * 1.1, 2 * 1.25, 2 * 1.5]]))
    assert clipped.tolist() == [[True, False, False, False]]


def test_clipped_pg_loss_gradient_zero_when_clipped():
    logp = torch.tensor([[math.log(1.5)]], requires_grad=True)
    loss, _ = grpo.clipped_pg_loss(logp, torch.zeros(1, 1), torch.tensor([1.0]), 0.2, 0.2)
    loss.sum().backward()
    assert logp.grad.item() == 0.0


LOSS_TOK = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]])


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", (6 + 4 + 2) / 6),
    ("seq-mean-token-sum", (6 + 4 + 2) / (3 * 4)),          # Dr. GRPO: / (sequences * max_new_tokens)
    ("seq-mean-token-mean", (6 / 3 + 4 / 1 + 2 / 2) / 3),   # GRPO paper
])
def test_loss_aggregation_modes(mode, expected):
    norm = grpo.loss_normaliser(MASK, mode, max_new_tokens=4)
    assert grpo.aggregate_loss(LOSS_TOK, MASK, mode, norm).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_loss_aggregation_split_invariant(mode):
    """Sum of per-micro-batch losses (normaliser from the whole mini-batch) equals the whole-batch loss."""
    torch.manual_seed(0)
    loss_tok, mask = torch.randn(8, 5), (torch.rand(8, 5) > 0.3).float()
    mask[3] = 0  # a fully masked row contributes nothing and does not break anything
    norm = grpo.loss_normaliser(mask, mode, 5)
    whole = grpo.aggregate_loss(loss_tok, mask, mode, norm)
    for parts in ([[0, 1, 2, 3, 4, 5, 6, 7]], [[0, 5], [1, 2, 7], [3], [4, 6]]):
        split = sum(grpo.aggregate_loss(loss_tok[p], mask[p], mode, norm) for p in parts)
        assert torch.allclose(split, whole, atol=1e-6)


def test_dynamic_sampling_keeps_informative_groups():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert grpo.dynamic_sampling_keep(r, 2).tolist() == [False, False, True, True, False, False]


def test_lr_schedule():
    assert grpo.lr_lambda(0, 4, 20, "constant") == pytest.approx(0.25)
    assert grpo.lr_lambda(3, 4, 20, "constant") == 1.0
    assert grpo.lr_lambda(4, 4, 20, "cosine") == pytest.approx(1.0)
    assert grpo.lr_lambda(20, 4, 20, "cosine") == pytest.approx(0.1)


def test_derived_geometry():
    a = grpo.Args(prompts_per_step=8, group_size=4, num_minibatches=2, num_epochs=3)
    assert (a.sequences_per_step, a.optimizer_steps_per_rollout, a.sequences_per_minibatch) == (32, 6, 16)
    assert a.recompute_old_logp
    assert not grpo.Args(num_minibatches=1, num_epochs=1).recompute_old_logp
