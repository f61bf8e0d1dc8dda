"""dpo.py's objectives of issue 25 (hinge, robust, exo_pair, sigmoid_norm), by hand: values, gradients at the start
(policy = reference), the token counts sigmoid_norm divides by, and bad --loss / --label-smoothing named before the
model loads. Every test drives dpo.py's own preference_loss / pair_losses / main."""
import json
import math
import os
import subprocess
import sys
import typing

import pytest
import torch

import dpo
from common.dist import Dist
from common.preference import Pair
from conftest import ROOT, run_scripts
from dpo import Args, pair_losses, preference_loss

t = lambda *x: torch.tensor(x, dtype=torch.float64)
log_sigmoid = lambda z: -math.log1p(math.exp(-z))
LOSSES = typing.get_args(typing.get_type_hints(Args)["loss"])


# ---- values by hand ------------------------------------------------------------------------------------------
# h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)); with these four, h = 1 - (-1) = 2.
PAIR = t(-10.0), t(-12.0), t(-11.0), t(-11.0)


def test_hinge_by_hand():
    assert float(preference_loss(*PAIR, "hinge", 0.1)) == pytest.approx(1 - 0.1 * 2)  # max(0, 1 - beta h)
    assert float(preference_loss(*PAIR, "hinge", 0.25)) == pytest.approx(0.5)
    assert float(preference_loss(t(-14.0), t(-9.0), t(-11.0), t(-11.0), "hinge", 0.1)) == pytest.approx(1.5)  # h=-5
    # past the margin (beta h = 2 >= 1): zero loss and no gradient
    logp_c = t(-10.0).requires_grad_()
    loss = preference_loss(logp_c, t(-12.0), t(-11.0), t(-11.0), "hinge", 1.0)
    loss.sum().backward()
    assert float(loss.detach()) == 0.0 and float(logp_c.grad) == 0.0


def test_robust_by_hand():
    z, eps = 0.1 * 2, 0.1
    by_hand = (-(1 - eps) * log_sigmoid(z) + eps * log_sigmoid(-z)) / (1 - 2 * eps)
    assert float(preference_loss(*PAIR, "robust", 0.1, label_smoothing=eps)) == pytest.approx(by_hand, abs=1e-12)
    assert by_hand == pytest.approx(0.57314, abs=1e-5)  # the number itself, not only the formula
    # eps = 0: plain DPO
    assert float(preference_loss(*PAIR, "robust", 0.1)) == pytest.approx(-log_sigmoid(z), abs=1e-12)
    # not bounded below: at beta h = 10, eps = 0.3 it is (0.7 * 4.54e-5 - 0.3 * 10.0000454) / 0.4 = -7.49995
    far = preference_loss(t(10.0), t(0.0), t(0.0), t(0.0), "robust", 1.0, label_smoothing=0.3)
    assert float(far) == pytest.approx(-7.49995, abs=1e-5)


def test_robust_is_unbiased_under_label_flips():
    """rDPO's point: if each label is flipped with probability eps, the expected robust loss is the clean DPO loss."""
    c, r, rc, rr = PAIR
    for eps in (0.1, 0.3, 0.45):
        kept = preference_loss(c, r, rc, rr, "robust", 0.1, label_smoothing=eps)
        flipped = preference_loss(r, c, rr, rc, "robust", 0.1, label_smoothing=eps)  # chosen and rejected swapped
        expected = (1 - eps) * kept + eps * flipped
        assert float(expected) == pytest.approx(float(preference_loss(*PAIR, "sigmoid", 0.1)), abs=1e-12)


def test_exo_pair_by_hand():
    # KL(q || p) with q = [s(beta h), s(-beta h)], p = [1 - eps, eps]
    eps, q = 0.1, 1 / (1 + math.exp(-0.2))
    by_hand = q * math.log(q / (1 - eps)) + (1 - q) * math.log((1 - q) / eps)
    assert float(preference_loss(*PAIR, "exo_pair", 0.1, label_smoothing=eps)) == pytest.approx(by_hand, abs=1e-12)
    assert by_hand == pytest.approx(0.40630, abs=1e-5)
    # h = 0 (policy = reference): q = [1/2, 1/2], KL = log(1/2) - (log(1 - eps) + log(eps)) / 2
    at_start = preference_loss(t(-3.0), t(-5.0), t(-3.0), t(-5.0), "exo_pair", 0.1, label_smoothing=eps)
    assert float(at_start) == pytest.approx(math.log(0.5) - 0.5 * math.log(eps * (1 - eps)), abs=1e-12)
    # the minimum, 0, where the policy's preference matches the label's: s(beta h) = 1 - eps, i.e. h = log 9 / beta
    h = math.log((1 - eps) / eps) / 0.1
    logp_c = t(h).requires_grad_()
    loss = preference_loss(logp_c, t(0.0), t(0.0), t(0.0), "exo_pair", 0.1, label_smoothing=eps)
    loss.sum().backward()
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-12) and float(logp_c.grad) == pytest.approx(0.0, abs=1e-12)


def test_sigmoid_norm_is_sigmoid_on_the_means():
    """preference_loss gets per-token means for sigmoid_norm (pair_losses divides; next test) and is then DPO's."""
    for eps in (0.0, 0.2):
        assert float(preference_loss(*PAIR, "sigmoid_norm", 0.1, label_smoothing=eps)) == pytest.approx(
            -(1 - eps) * log_sigmoid(0.2) - eps * log_sigmoid(-0.2), abs=1e-12)


# ---- gradients at the start: d loss / d log pi(y_w) at h = 0, by hand -------------------------------------------
BETA, EPS = 0.1, 0.1
START_GRADIENT = {
    "sigmoid": -BETA * (1 - 2 * EPS) / 2,                           # -beta [(1-eps) s(0) - eps s(0)]
    "sigmoid_norm": -BETA * (1 - 2 * EPS) / 2,
    "hinge": -BETA,                                                  # inside the margin: -beta
    "robust": -BETA / (2 * (1 - 2 * EPS)),                           # -beta [(1-eps) s(0) + eps s(0)] / (1 - 2 eps)
    "exo_pair": -BETA / 4 * math.log((1 - EPS) / EPS),              # s'(0) (0 - log((1-eps)/eps)) beta
    "ipo": -1 / BETA,                                                # 2 (0 - 1/(2 beta))
}


@pytest.mark.parametrize("loss", list(START_GRADIENT))
def test_gradient_at_the_start_by_hand(loss):
    logp_c = t(-3.0).requires_grad_()
    preference_loss(logp_c, t(-5.0), t(-3.0), t(-5.0), loss, BETA, label_smoothing=EPS).sum().backward()
    assert float(logp_c.grad) == pytest.approx(START_GRADIENT[loss], abs=1e-12)


# ---- sigmoid_norm divides by the response token counts -----------------------------------------------------------
def test_pair_losses_sigmoid_norm_uses_token_counts(monkeypatch):
    """pair_losses with the packed forward replaced by known sums: chosen has 2 response tokens, rejected 4."""
    pairs = [Pair(prompt_ids=[1, 2, 3], chosen_ids=[5, 6], rejected_ids=[7, 8, 9, 10])]
    sums = t(-4.0, -12.0).view(1, 2)  # log pi summed over [chosen, rejected]
    ref_table = t(-6.0, -8.0).view(1, 2)  # log pi_ref summed
    monkeypatch.setattr(dpo, "pack_pairs", lambda pairs, ids: torch.nn.Identity())
    monkeypatch.setattr(dpo, "response_logp_sums", lambda model, mb: sums.clone())
    # means: chosen -2 vs -3 (+1), rejected -3 vs -2 (-1): h = 2;  with sums h = 2 - (-4) = 6
    for loss, h in (("sigmoid_norm", 2.0), ("sigmoid", 6.0)):
        losses, rewards, logp = pair_losses(None, pairs, [0], ref_table, None, Args(loss=loss, beta=0.1), "cpu")
        assert float(losses) == pytest.approx(-log_sigmoid(0.1 * h), abs=1e-12)
    assert rewards[0].tolist() == pytest.approx([0.2, -0.4])  # sigmoid: beta (sum log pi - sum log pi_ref)
    losses, rewards, logp = pair_losses(None, pairs, [0], ref_table, None, Args(loss="sigmoid_norm"), "cpu")
    assert rewards[0].tolist() == pytest.approx([0.1, -0.1]) and logp[0].tolist() == [-2.0, -3.0]  # on the means


# ---- every --loss choice works; bad ones are named before the model loads -------------------------------------
def test_every_loss_choice_has_a_branch_and_a_docs_row():
    docs = (ROOT / "docs" / "dpo.md").read_text()
    for loss in LOSSES:
        value = preference_loss(*PAIR, loss, 0.1, label_smoothing=0.1)
        assert torch.isfinite(value).all(), loss
        assert f"| `{loss}` |" in docs, f"docs/dpo.md has no row for --loss {loss}"
    assert set(LOSSES) == {"sigmoid", "sigmoid_norm", "ipo", "simpo", "hinge", "robust", "exo_pair"}


@pytest.mark.parametrize("loss,eps,message", [
    ("exo", 0.0, "--loss 'exo': use sigmoid, sigmoid_norm, ipo, simpo, hinge, robust or exo_pair"),
    ("exo_pair", 0.0, r"--label-smoothing 0.0 with --loss exo_pair: must be in \(0, 1\)"),
    ("robust", 0.5, r"--label-smoothing 0.5 with --loss robust: must be in \[0, 0.5\)"),
    ("sigmoid", -0.1, r"--label-smoothing -0.1 with --loss sigmoid: must be in \[0, 1\]"),
    ("hinge", float("nan"), "--label-smoothing nan with --loss hinge"),
])
def test_bad_loss_flags_rejected_before_the_model_loads(monkeypatch, tmp_path, loss, eps, message):
    with pytest.raises(ValueError, match=message):
        preference_loss(*PAIR, loss, 0.1, label_smoothing=eps)

    def model_loaded(*a, **k):
        raise AssertionError("the model was loaded before the bad flag was reported")
    monkeypatch.setattr(dpo.D, "init_distributed", lambda device="auto": Dist(0, 1, 0, torch.device("cpu")))
    monkeypatch.setattr(dpo, "resolve_model_once", model_loaded)
    monkeypatch.setattr(dpo.D, "seed_everything", lambda seed: None)
    with pytest.raises(ValueError, match=message):
        dpo.main(Args(loss=loss, label_smoothing=eps, out_dir=str(tmp_path)))
    assert not any(tmp_path.iterdir())  # no run folder claimed either


def test_reference_cache_spec_follows_the_data_flags():
    """common.preference.reference_cache_spec (moved out of dpo.py's main): the same flags give the same spec, a
    data flag or the chat template changes it; --loss, --beta and --lr (not what pi_ref computes) do not."""
    from types import SimpleNamespace
    from common.preference import reference_cache_spec
    tok = SimpleNamespace(chat_template="T")
    spec = reference_cache_spec(Args(), tok, "cpu")
    assert spec == reference_cache_spec(Args(), SimpleNamespace(chat_template="T"), "cpu")
    assert spec["max_length"] == Args().max_length and spec["device"] == "cpu"
    for changed in (Args(max_length=7), Args(eval_fraction=0.5), Args(chosen_field="good"), Args(seed=2)):
        assert reference_cache_spec(changed, tok, "cpu") != spec
    assert reference_cache_spec(Args(), SimpleNamespace(chat_template="U"), "cpu") != spec
    assert reference_cache_spec(Args(), tok, "cuda") != spec
    assert reference_cache_spec(Args(loss="robust", beta=0.5, lr=1.0), tok, "cpu") == spec


def test_cli_exo_pair_without_eps_named_before_model(tmp_path):
    p = subprocess.run([sys.executable, "dpo.py", "--loss", "exo_pair", "--model", str(tmp_path / "no-such-model"),
                        "--out-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"})
    assert p.returncode != 0
    assert "--label-smoothing 0.0 with --loss exo_pair" in p.stderr and "no-such-model" not in p.stderr


@pytest.mark.slow
def test_new_losses_end_to_end_cpu(tmp_path, tiny_model_dir):
    """`dpo.py --loss sigmoid_norm` and `--loss exo_pair` on one CPU rank: at step 0 the policy is the reference
    (h = 0), so the train loss is known by hand (log 2; log(1/2) - log(eps (1 - eps)) / 2); then the policy moves."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + {i} =", "chosen": f" {2 * i}.", "rejected": " no" + "!" * i})
                            + "\n" for i in range(12)))
    eps = 1e-3
    starts = {"sigmoid_norm": math.log(2), "exo_pair": math.log(0.5) - 0.5 * math.log(eps * (1 - eps))}
    runs = run_scripts({loss: [
        "dpo.py", "--model", str(tiny_model_dir), "--dataset", str(data), "--loss", loss, "--label-smoothing",
        str(eps if loss == "exo_pair" else 0.0), "--pairs-per-step", "4", "--num-steps", "2", "--eval-every", "0",
        "--max-length", "64", "--max-tokens-per-microbatch", "256", "--lr", "1e-2", "--out-dir", str(tmp_path / loss),
        "--cache-dir", str(tmp_path / "cache")] for loss in starts}, tmp_path / "driver")
    for loss, at_start in starts.items():
        out = tmp_path / loss
        assert runs[loss].returncode == 0, runs[loss].stderr[-3000:]
        rows = [json.loads(x) for x in (out / "dpo" / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if "train/loss" in r]
        assert [r["step"] for r in train] == [0, 1]
        assert train[0]["train/loss"] == pytest.approx(at_start, abs=1e-4), loss
        assert train[1]["train/loss"] != pytest.approx(at_start, abs=1e-6), loss  # the policy moved
        assert json.loads((out / "dpo" / "config.json").read_text())["loss"] == loss
