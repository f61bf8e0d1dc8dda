"""common/packing.py and common/attention.py: packed rows give the same log-probs as sequences run alone;
micro-batch planning and rank sharding; the varlen attention against sdpa."""
import random

import pytest
import torch
import torch.nn.functional as F

from common.attention import (attn_kwargs, backend, cu_seqlens_from_position_ids, reference_varlen_attention,
                              describe, register_varlen_attention, varlen_attention_forward)
from common.models import TokenLogProbs, load_causal_lm
from common.packing import balanced_partition, pack, plan_microbatches, shard_microbatches

# three sequences of different lengths: (prompt ids, response ids)
PROMPTS = [[11, 12, 13, 14, 15], [21, 22], [31, 32, 33, 34, 35, 36, 37, 38]]
RESPONSES = [[101, 102, 103], [201, 202, 203, 204, 205, 206], [301, 302]]
WIDTH = 6


def alone_logp(model, i):
    """log p of response i with the sequence run by itself (no packing, no padding)."""
    mb = pack(PROMPTS, RESPONSES, [i])
    logp, _ = model(mb.input_ids, mb.position_ids, mb.targets)
    return mb.unpack(logp, WIDTH)[0]


@pytest.mark.parametrize("attn", ["sdpa", "eager", "varlen"])
@pytest.mark.parametrize("with_kwargs", [True, False])
def test_packed_logprobs_equal_unpacked(tiny_model_dir, attn, with_kwargs):
    if attn == "varlen":
        register_varlen_attention()
    model = TokenLogProbs(load_causal_lm(str(tiny_model_dir), attn, trainable=False), impl="torch")
    mb = pack(PROMPTS, RESPONSES, [0, 1, 2])
    kw = attn_kwargs(mb) if with_kwargs else {}
    with torch.no_grad():
        logp, _ = model(mb.input_ids, mb.position_ids, mb.targets, **kw)
        packed = mb.unpack(logp, WIDTH)  # (3, WIDTH)
        for i in range(3):
            torch.testing.assert_close(packed[i], alone_logp(model, i), atol=1e-5, rtol=0)
            assert packed[i, len(RESPONSES[i]):].abs().sum() == 0


def test_scored_positions_given_or_found_agree(tiny_model_dir):
    """TokenLogProbs(scored=mb.pos) (no device sync) equals finding the scored positions from the targets."""
    model = TokenLogProbs(load_causal_lm(str(tiny_model_dir), "sdpa", trainable=False), impl="torch")
    mb = pack(PROMPTS, RESPONSES, [2, 0, 1])
    assert mb.index.tolist() == [2, 0, 1]
    assert mb.pos.tolist() == (mb.targets[0] != -100).nonzero().flatten().tolist()
    with torch.no_grad():
        found = model(mb.input_ids, mb.position_ids, mb.targets)
        given = model(mb.input_ids, mb.position_ids, mb.targets, scored=mb.pos)
    for a, b in zip(found, given):
        assert torch.equal(a, b)


def test_varlen_gradients_match_sdpa(tiny_model_dir):
    """Same loss, same gradients through the packed varlen path and the packed sdpa path."""
    name = register_varlen_attention()
    mb = pack(PROMPTS, RESPONSES, [0, 1, 2])
    grads = []
    for attn, kw in (("sdpa", {}), (name, attn_kwargs(mb))):
        model = TokenLogProbs(load_causal_lm(str(tiny_model_dir), attn), impl="torch")
        logp, _ = model(mb.input_ids, mb.position_ids, mb.targets, **kw)
        logp.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


def test_varlen_builds_no_mask(tiny_model_dir, monkeypatch):
    """transformers hands the varlen function attention_mask=None (no (T, T) mask is built)."""
    import common.attention as A
    register_varlen_attention()
    seen = []

    def spy(module, q, k, v, attention_mask, **kw):
        seen.append((attention_mask, kw.get("cu_seq_lens_q")))
        return varlen_attention_forward(module, q, k, v, attention_mask, **kw)

    from transformers import AttentionInterface
    AttentionInterface.register(A.NAME, spy)
    try:
        model = TokenLogProbs(load_causal_lm(str(tiny_model_dir), A.NAME, trainable=False), impl="torch")
        mb = pack(PROMPTS, RESPONSES, [0, 1, 2])
        with torch.no_grad():
            model(mb.input_ids, mb.position_ids, mb.targets, **attn_kwargs(mb))
    finally:
        register_varlen_attention()
    assert seen and all(m is None for m, _ in seen)
    assert all(torch.equal(cu, mb.cu_seqlens) for _, cu in seen)


def test_cu_seqlens_from_position_ids():
    mb = pack(PROMPTS, RESPONSES, [0, 1, 2])
    cu, max_len = cu_seqlens_from_position_ids(mb.position_ids)
    assert cu.tolist() == mb.cu_seqlens.tolist() == [0, 8, 16, 26]
    assert max_len == mb.max_seqlen == 10
    # two rows: every row starts a sequence even if its positions continue
    cu, max_len = cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 0, 1], [5, 6, 0, 1, 2]]))
    assert cu.tolist() == [0, 3, 5, 7, 10] and max_len == 3


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_reference_varlen_matches_masked_sdpa(hq, hkv):
    g = torch.Generator().manual_seed(0)
    lens = [5, 1, 9, 3]
    N, D = sum(lens), 8
    q = torch.randn(N, hq, D, generator=g)
    k, v = torch.randn(N, hkv, D, generator=g), torch.randn(N, hkv, D, generator=g)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))  # (N,)
    mask = (seq[:, None] == seq[None]) & torch.ones(N, N, dtype=torch.bool).tril()  # block-diagonal causal
    kk, vv = (x.repeat_interleave(hq // hkv, 1) for x in (k, v))
    want = F.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
                                          attn_mask=mask, scale=0.3).transpose(0, 1)
    torch.testing.assert_close(reference_varlen_attention(q, k, v, cu, scale=0.3), want, atol=1e-5, rtol=1e-5)


# ---- planning and sharding ----------------------------------------------------------------------------------
def random_lengths(n, seed, lo=1, hi=300):
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_plan_microbatches_respects_budget(seed):
    lengths = random_lengths(50, seed)
    rows = list(range(0, 50, 2)) + [1, 7]
    plan = plan_microbatches(lengths, rows, max_tokens=512)
    assert sorted(i for mb in plan for i in mb) == sorted(rows)  # every row exactly once
    assert all(sum(lengths[i] for i in mb) <= 512 for mb in plan)
    assert len(plan) <= 2 * sum(lengths[i] for i in rows) / 512 + 1  # first-fit decreasing packs tightly


def test_plan_microbatches_rejects_overlong():
    with pytest.raises(ValueError, match="max-tokens-per-microbatch"):
        plan_microbatches([10, 600], [0, 1], max_tokens=512)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_shard_microbatches_same_count_and_balanced(world):
    lengths = random_lengths(64, world, lo=200, hi=768)
    rows = list(range(64))
    shards = [shard_microbatches(lengths, rows, world, r, 4096) for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # same number of FSDP forward/backward calls on every rank
    assert sorted(i for s in shards for mb in s for i in mb) == rows
    loads = [sum(lengths[i] for mb in s for i in mb) for s in shards]
    assert max(loads) - min(loads) <= max(lengths)  # greedy longest-first: within one sequence
    for s in shards:
        assert all(sum(lengths[i] for i in mb) <= 4096 for mb in s)


def test_shard_microbatches_pads_with_empty():
    shards = [shard_microbatches([100, 100, 100], [0, 1, 2], 4, r, 150) for r in range(4)]
    assert [len(s) for s in shards] == [1, 1, 1, 1]
    assert sum(mb == [] for s in shards for mb in s) == 1
    dummy = pack(PROMPTS, RESPONSES, [])
    assert dummy.num_tokens == 1 and (dummy.targets == -100).all() and dummy.row.numel() == 0


def test_balanced_partition_deterministic():
    lengths = random_lengths(40, 0)
    a, b = balanced_partition(lengths, 3), balanced_partition(list(lengths), 3)
    assert a == b
    assert sorted(i for g in a for i in g) == list(range(40))
    assert all(g == sorted(g) for g in a)
    assert balanced_partition([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]  # ties broken by index


def test_unpack_pack_roundtrip():
    mb = pack(PROMPTS, RESPONSES, [2, 0])
    assert mb.input_ids[0].tolist() == PROMPTS[2] + RESPONSES[2] + PROMPTS[0] + RESPONSES[0]
    assert mb.position_ids[0].tolist() == list(range(10)) + list(range(8))
    # the targets at the predicting positions are the response tokens, and unpack puts them back in place
    got = mb.unpack(mb.targets.float(), WIDTH)  # (2, WIDTH)
    for r, i in enumerate([2, 0]):
        assert got[r, :len(RESPONSES[i])].long().tolist() == RESPONSES[i]
        assert got[r, len(RESPONSES[i]):].abs().sum() == 0
    assert int((mb.targets != -100).sum()) == len(RESPONSES[2]) + len(RESPONSES[0])


# ---- GPU ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 256])
@pytest.mark.parametrize("hq,hkv", [(14, 2), (8, 8)])
def test_varlen_kernel_matches_sdpa_cuda_bf16(hq, hkv, window):
    """The CUDA varlen kernel (flash-attn or torch varlen_attn) against per-sequence sdpa, values and gradients,
    with grouped KV heads as register_varlen_attention's probe decided (unexpanded if the kernel takes them), and
    with a sliding window (transformers' W: the last W keys, the query's own included)."""
    register_varlen_attention()
    assert backend(torch.device("cuda"), torch.bfloat16) != "reference"
    print("varlen attention:", describe(torch.device("cuda"), torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    lens = [768, 300, 1, 513, 1024, 490]
    N, D = sum(lens), 64
    make = lambda h: (torch.randn(1, h, N, D, generator=g)).cuda().bfloat16().requires_grad_()
    q, k, v = make(hq), make(hkv), make(hkv)  # (1, H, N, D) as transformers passes them
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).cuda()
    kw = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lens), "max_length_k": max(lens)}
    out, _ = varlen_attention_forward(None, q, k, v, None, scaling=D ** -0.5, sliding_window=window, **kw)
    flat = lambda x: x[0].transpose(0, 1)  # (N, H, D)
    want = reference_varlen_attention(flat(q).float(), flat(k).float(), flat(v).float(), cu, D ** -0.5, window=window)
    torch.testing.assert_close(out[0].float(), want, atol=2e-2, rtol=2e-2)
    dout = torch.randn_like(out)
    got_grads = torch.autograd.grad(out, (q, k, v), dout)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = reference_varlen_attention(flat(qf), flat(kf), flat(vf), cu, D ** -0.5, window=window)
    want_grads = torch.autograd.grad(ref, (qf, kf, vf), dout[0].float())
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a.float(), b, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
def test_packed_logprobs_varlen_vs_sdpa_cuda_bf16(tiny_model_dir):
    name = register_varlen_attention()
    mb = pack(PROMPTS, RESPONSES, [0, 1, 2]).to("cuda")
    out = []
    for attn, kw in (("sdpa", {}), (name, attn_kwargs(mb))):
        model = TokenLogProbs(load_causal_lm(str(tiny_model_dir), attn, trainable=False), impl="torch")
        model = model.to("cuda", torch.bfloat16)
        with torch.no_grad():
            out.append(model(mb.input_ids, mb.position_ids, mb.targets, **kw)[0])
    torch.testing.assert_close(out[1], out[0], atol=3e-2, rtol=0)
