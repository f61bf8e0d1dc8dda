"""--fused-loss in the scripts: grpo.learn_minibatch, ppo.learn_minibatch and sft.learn_step with the loss's gradient computed inside
the LM head's forward (common.models.TokenLoss -> kernels.token_loss) give the loss, every logged statistic and the
gradients of the unfused path (token_logprobs, then the loss). tests/fused_loss_driver.py runs both on one synthetic
rollout (a tiny Llama; without a GPU the kernels run in Triton's interpreter)."""
import os
import subprocess
import sys

import pytest
import torch

from common.models import TokenLoss, linear_weights
from common.packing import pack
from conftest import ROOT

CASES = ("grpo-token-mean", "grpo-seq-mean", "grpo-gspo", "ppo-token-mean", "ppo-warmup", "sft")


def run_driver(out, device):
    env = {k: v for k, v in os.environ.items()  # a process-group left by an in-process test must not leak in
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    path = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env |= {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    p = subprocess.run([sys.executable, "tests/fused_loss_driver.py", str(out), device, *CASES], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"driver failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return torch.load(out)


def check_equal(results, rtol_stats, rtol_grad):
    for name in CASES:
        fused, plain = results[name]["fused"], results[name]["plain"]
        # the fused path ran where it applies (one token_loss per micro-batch), and not for GSPO's sequence ratio
        assert (fused["token_loss_calls"] > 0) == (name != "grpo-gspo"), (name, fused["token_loss_calls"])
        assert plain["token_loss_calls"] == 0
        assert plain["stats"]["tokens"] > 0 and plain["loss"] != 0
        assert torch.allclose(fused["loss"], plain["loss"], rtol=rtol_stats, atol=1e-6), \
            f"{name}: loss {fused['loss']} != {plain['loss']}"
        for k, want in plain["stats"].items():
            got = fused["stats"][k]
            assert torch.allclose(got, want, rtol=rtol_stats, atol=1e-5), f"{name}: stats[{k}] {got} != {want}"
        total = sum(float(g.norm()) ** 2 for g in plain["grads"].values() if g is not None) ** 0.5
        assert total > 0
        for k, want in plain["grads"].items():
            got = fused["grads"][k]
            if want is None:
                assert got is None or not got.any(), f"{name}: {k} has a gradient only on the fused path"
                continue
            err = float((got - want).norm())
            assert err <= rtol_grad * max(float(want.norm()), 1e-3 * total), \
                f"{name}: gradient of {k} differs by {err:.3g} (norm {float(want.norm()):.3g})"


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory):
    return run_driver(tmp_path_factory.mktemp("fused") / "out.pt", "cpu")


def test_fused_loss_equals_unfused_path(cpu_results):
    # the cases exercise what the loss has: clipped and unclipped tokens, TIS weights (some capped, some tokens without
    # an engine log-prob), the KL and entropy terms, a masked token, several micro-batches, per-token and per-sequence
    # advantages, pi_old = pi.detach(), and ppo.py's critic warm-up (no policy gradient)
    stats = cpu_results["grpo-token-mean"]["plain"]["stats"]
    assert 0 < stats["clip_frac"] < stats["tokens"]
    assert 0 < stats["tis_w"] < stats["tokens"] and stats["kl"] > 0
    check_equal(cpu_results, rtol_stats=1e-5, rtol_grad=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_loss_equals_unfused_path_gpu(tmp_path):
    # bf16 compute: the fused loss's dW is rounded once per block of rows, the reference's not at all
    check_equal(run_driver(tmp_path / "out.pt", "cuda"), rtol_stats=1e-3, rtol_grad=3e-2)


def test_take_is_unpacks_inverse():
    prompts, responses = [[1, 2], [3], [4, 5, 6]], [[7, 8, 9], [10], [11, 12]]
    mb = pack(prompts, responses, [2, 0])  # rows of the caller's batch, in another order
    values = torch.arange(3 * 4, dtype=torch.float32).view(3, 4)  # (B, width)
    packed = torch.zeros(1, mb.num_tokens)
    packed[0, mb.pos] = mb.take(values)
    assert torch.equal(mb.unpack(packed, 4), values[[2, 0]] * (torch.arange(4) < torch.tensor([[2], [3]])))
    assert mb.take(torch.tensor([5.0, 6.0, 7.0])).tolist() == [7.0, 7.0, 5.0, 5.0, 5.0]  # per sequence
    assert mb.take(None) is None


def test_linear_weights_are_the_aggregation():
    import grpo
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [0, 0, 0]])
    loss_tok = torch.randn(3, 3)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum-verl"):
        n = grpo.loss_normaliser(mask, agg, 3)
        w = linear_weights(lambda x: grpo.aggregate_loss(x, mask, agg, n), mask)
        assert torch.allclose((w * loss_tok).sum(), grpo.aggregate_loss(loss_tok, mask, agg, n)), agg


def test_runs_fused_only_with_the_kernel():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not TokenLoss.runs_fused(True, "auto", cpu)  # the torch reference on CPU: nothing to fuse
    assert TokenLoss.runs_fused(True, "fused", cpu)
    assert not TokenLoss.runs_fused(False, "fused", cpu)  # --no-fused-loss
    assert not TokenLoss.runs_fused(True, "torch", cuda)
