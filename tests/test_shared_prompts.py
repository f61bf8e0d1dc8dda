"""Shared prompts (--share-prompts, the RL scripts' default): a micro-batch holds a group's prompt once and each
response attends to it through kv_index (common.packing.pack_shared, common.attention). The log-probs, grpo.py's loss,
statistics and gradients equal those of whole sequences (tests/shared_prompts_driver.py drives the script's update)."""
import os
import subprocess
import sys

import pytest
import torch

from common.attention import attn_kwargs, reference_varlen_attention, varlen_attention_forward
from common.packing import pack, pack_shared, prompt_units, shard_shared_microbatches
from conftest import ROOT


def test_pack_shared_layout():
    prompts = [[5, 6, 7], [9], [5, 6, 7]]
    responses = [[1, 2], [3], [4]]
    mb = pack_shared(prompts, responses, [0, 1, 2])
    assert mb.rows == [0, 2, 1]  # grouped by prompt, in order of first appearance
    assert mb.input_ids.tolist() == [[5, 6, 7, 1, 2, 7, 4, 9, 3]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3, 0, 1]]  # responses continue from the prompt
    assert mb.targets.tolist() == [[-100, -100, 1, 2, -100, 4, -100, 3, -100]]  # each copy of 7 predicts its response
    assert mb.cu_seqlens.tolist() == [0, 2, 5, 7, 9]  # [5 6], [7 1 2], [7 4], [9 3] (prompt [9] has no head)
    assert mb.kv_index.tolist() == [0, 1, 0, 1, 2, 3, 4, 0, 1, 5, 6, 7, 8]
    assert mb.cu_seqlens_k.tolist() == [0, 2, 7, 11, 13]
    assert (mb.max_seqlen, mb.max_seqlen_k) == (3, 5)
    assert mb.pos.tolist() == [2, 3, 5, 7] and mb.row.tolist() == [0, 0, 1, 2] and mb.col.tolist() == [0, 1, 0, 0]
    assert prompt_units(prompts, responses, [0, 1, 2], 100) == ([[0, 2], [1]], [7, 2])  # 9 tokens laid out
    whole = pack(prompts, responses, [0, 2, 1])  # the same targets, in the same order
    assert whole.targets[whole.targets != -100].tolist() == mb.targets[mb.targets != -100].tolist()
    assert pack_shared(prompts, responses, []).num_tokens == 1  # the padding micro-batch, unshared
    with pytest.raises(ValueError, match="empty prompt"):
        pack_shared([[]], [[1]], [0])


def test_reference_attention_aligns_keys_at_the_end():
    # a segment with more keys than queries: query i sees keys up to s - t + i, as the whole sequence's tail would
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, h, 8, generator=g) for h in (4, 2, 2))
    full = reference_varlen_attention(q, k, v, torch.tensor([0, 7]))
    tail = reference_varlen_attention(q[3:], k, v, torch.tensor([0, 4]), cu_seqlens_k=torch.tensor([0, 7]))
    torch.testing.assert_close(tail, full[3:])


@pytest.mark.parametrize("window", [None, 3])
def test_attention_gathers_the_shared_keys(window):
    # varlen_attention_forward with a pack_shared micro-batch equals whole-sequence attention at the same tokens,
    # also with a sliding window shorter than the prompt (the keys' positions are the whole sequence's)
    prompts, responses = [[1, 2, 3, 4], [1, 2, 3, 4]], [[5, 6], [7, 8, 9]]
    shared, whole = pack_shared(prompts, responses, [0, 1]), pack(prompts, responses, [0, 1])
    g = torch.Generator().manual_seed(1)
    proj = [torch.randn(16, h * 8, generator=g) for h in (4, 2, 2)]
    emb = torch.randn(16, 16, generator=g)  # token -> features, plus a position term so positions matter
    def qkv(mb):
        x = emb[mb.input_ids[0]] + 0.1 * mb.position_ids[0, :, None].float()
        return [(x @ p).view(1, -1, p.shape[1] // 8, 8).transpose(1, 2) for p in proj]  # (1, H, T, D)
    out_s, _ = varlen_attention_forward(None, *qkv(shared), None, sliding_window=window, **attn_kwargs(shared))
    out_w, _ = varlen_attention_forward(None, *qkv(whole), None, sliding_window=window, **attn_kwargs(whole))
    torch.testing.assert_close(out_s[0, shared.pos], out_w[0, whole.pos])  # every position that predicts a token


def test_reference_attention_sliding_window_is_transformers_mask():
    # window W: query p sees keys p - W + 1 .. p, as transformers' sliding_window_overlay (kv > q - W) on top of causal
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(9, h, 8, generator=g) for h in (4, 2, 2))
    allowed = torch.ones(9, 9, dtype=torch.bool).tril() & (torch.arange(9)[None] > torch.arange(9)[:, None] - 3)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=allowed).transpose(0, 1)
    torch.testing.assert_close(reference_varlen_attention(q, k, v, torch.tensor([0, 9]), window=3), want)
    tail = reference_varlen_attention(q[4:], k, v, torch.tensor([0, 5]), cu_seqlens_k=torch.tensor([0, 9]), window=3)
    torch.testing.assert_close(tail, want[4:])  # keys aligned at the end, the window counted in the keys' positions


def test_shard_shared_microbatches():
    prompts = [[1] * 6] * 4 + [[2] * 3] * 3 + [[3] * 10]
    responses = [[0] * n for n in (4, 1, 6, 2, 5, 5, 5, 9)]
    rows = list(range(8))
    for world, budget in ((1, 1000), (1, 19), (2, 20), (3, 25)):
        plans = [shard_shared_microbatches(prompts, responses, rows, world, r, budget) for r in range(world)]
        assert len({len(p) for p in plans}) == 1  # every rank the same number of micro-batches
        seen = sorted(i for p in plans for mb in p for i in mb)
        assert seen == rows, (world, budget, plans)
        for p in plans:
            assert all(pack_shared(prompts, responses, mb).num_tokens <= budget for mb in p if mb)
    assert shard_shared_microbatches(prompts, responses, rows, 1, 0, 1000) == [rows]
    # a group that fits stays in one micro-batch (prompt [1]*6: 5 + 5 + 2 + 7 + 3 = 22 tokens), one that does not is cut
    plan = shard_shared_microbatches(prompts, responses, rows, 1, 0, 22)
    assert any(set(range(4)) <= set(mb) for mb in plan), plan
    plan = shard_shared_microbatches(prompts, responses, rows, 1, 0, 21)
    assert not any(set(range(4)) <= set(mb) for mb in plan), plan
    with pytest.raises(ValueError, match="max-tokens-per-microbatch"):
        shard_shared_microbatches(prompts, responses, rows, 1, 0, 18)  # the last sequence alone has 19 tokens


def test_share_prompts_needs_varlen():
    from transformers import LlamaConfig, LlamaForCausalLM
    from common.models import TokenLogProbs
    lm = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      vocab_size=32, attn_implementation="sdpa"))
    with pytest.raises(ValueError, match="--attn-impl varlen"):
        TokenLogProbs(lm, share_prompts=True)


def run_driver(out, device):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    path = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env |= {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    p = subprocess.run([sys.executable, "tests/shared_prompts_driver.py", str(out), device], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"driver failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return torch.load(out)["results"]


def check_equal(results, atol_logp, rtol_stats, rtol_grad):
    for budget, r in results.items():
        shared, whole = r[True], r[False]
        assert {k for k, _ in shared["packed"]} == {"pack_shared"} and {k for k, _ in whole["packed"]} == {"pack"}
        # fewer tokens laid out: each group's prompt once
        assert sum(n for _, n in shared["packed"]) < sum(n for _, n in whole["packed"]), budget
        assert whole["logp"].abs().sum() > 0 and whole["stats"]["tokens"] > 0
        torch.testing.assert_close(shared["logp"], whole["logp"], atol=atol_logp, rtol=0)
        torch.testing.assert_close(shared["loss"], whole["loss"], rtol=rtol_stats, atol=1e-5)
        for k, want in whole["stats"].items():
            torch.testing.assert_close(shared["stats"][k], want, rtol=rtol_stats, atol=1e-4, msg=f"{budget}: {k}")
        assert shared["grads"].keys() == whole["grads"].keys()
        total = sum(float(g.norm()) ** 2 for g in whole["grads"].values()) ** 0.5
        assert total > 0
        for k, want in whole["grads"].items():
            err = float((shared["grads"][k] - want).norm())
            assert err <= rtol_grad * max(float(want.norm()), 1e-3 * total), f"{budget}: {k} differs by {err:.3g}"


def test_shared_prompts_equal_whole_sequences(tmp_path):
    check_equal(run_driver(tmp_path / "out.pt", "cpu"), atol_logp=1e-5, rtol_stats=1e-5, rtol_grad=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_shared_prompts_equal_whole_sequences_gpu(tmp_path):
    # bf16 compute, torch's varlen kernel (its causal mask aligned at the end of the keys) and the fused loss
    check_equal(run_driver(tmp_path / "out.pt", "cuda"), atol_logp=0.05, rtol_stats=2e-2, rtol_grad=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_attention_gathers_the_shared_keys_gpu():
    from common.attention import backend, register_varlen_attention
    register_varlen_attention()
    prompts = [[1] * 40 + [2] * 30] * 3
    responses = [[3] * 50, [4] * 20, [5] * 64]
    shared, whole = (f(prompts, responses, [0, 1, 2]).to("cuda") for f in (pack_shared, pack))
    g = torch.Generator(device="cuda").manual_seed(0)
    proj = [torch.randn(64, h * 64, device="cuda", generator=g) / 8 for h in (14, 2, 2)]
    emb = torch.randn(8, 64, device="cuda", generator=g)
    def qkv(mb):
        x = emb[mb.input_ids[0]] + 0.05 * mb.position_ids[0, :, None].float()
        return [(x @ p).view(1, -1, p.shape[1] // 64, 64).transpose(1, 2).bfloat16() for p in proj]
    assert backend(torch.device("cuda"), torch.bfloat16) != "reference"
    out_s, _ = varlen_attention_forward(None, *qkv(shared), None, **attn_kwargs(shared))
    out_w, _ = varlen_attention_forward(None, *qkv(whole), None, **attn_kwargs(whole))
    torch.testing.assert_close(out_s[0, shared.pos].float(), out_w[0, whole.pos].float(), atol=2e-2, rtol=2e-2)
