"""kernels.logprob.token_loss (the loss's gradient computed inside the forward) against loss_fn applied to the
fp32 reference log-probs and entropies: loss value, logp, entropy, dh and dW.

Without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1, tiny shapes). Tests marked gpu run
large shapes on CUDA.
"""

import importlib
import types
import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads TRITON_INTERPRET when a kernel is decorated: when kernels.logprob is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels.logprob as lp  # noqa: E402

if lp.HAS_TRITON and not torch.cuda.is_available() and lp._interpreting():
    # kernels.logprob may have been imported (compiled mode) by an earlier test module.
    if type(lp._stats_update_kernel).__name__ != "InterpretedFunction":
        lp = importlib.reload(lp)

import grpo  # noqa: E402
from common.models import TokenLogProbs  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not lp.HAS_TRITON, reason="triton not installed")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = {  # (values rtol, atol), (gradients rtol, atol): as tests/test_kernels.py
    torch.float32: ((1e-5, 1e-5), (1e-5, 1e-5)),
    torch.bfloat16: ((1e-5, 1e-4), (2e-2, 1e-3)),
}
# The summed loss in bf16: the H200 (2026-12-01) measured 5.2e-5 and 1.07e-5 relative to the fp32 reference on the
# two bf16 GPU cases (the curved loss's exp(-logp) terms sum to -9e11 there), past the per-token 1e-5.
LOSS_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-4}


def make_inputs(N, H, V, dtype, device=DEV, seed=0, n_masked=2):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(device=device, dtype=dtype)  # (N, H)
    weight = (torch.randn(V, H, generator=g) / H**0.5 * 2).to(device=device, dtype=dtype)  # (V, H)
    targets = torch.randint(0, V, (N,), generator=g)  # (N,)
    targets[torch.randperm(N, generator=g)[:n_masked]] = lp.IGNORE_INDEX
    a, b = torch.randn(2, N, generator=g).to(device)  # per-token constants, (N,) each
    return hidden, weight, targets.to(device), a, b


def linear(logp, entropy, a, b):
    """The loss that token_logprobs's tests backpropagate: upstream gradients a, b."""
    return a * logp + b * entropy


def curved(logp, entropy, a, b):
    """Nonlinear in both, as GRPO's ratio and k3 KL are."""
    return a * torch.exp(logp) + b * entropy**2 - torch.exp(-logp) * (b > 0)


def run(impl, hidden, weight, targets, loss_fn, token_args, temperature=1.0, upstream=1.0, **settings):
    """(loss, logp, entropy, dh, dW) of (upstream * loss).backward(); impl "torch" on fp32 copies (the reference)."""
    if impl == "torch":
        hidden, weight = hidden.float(), weight.float()
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss, logp, ent = lp.token_loss(h, w, targets, loss_fn, token_args, temperature, impl=impl, **settings)
    assert loss.dim() == 0 and not logp.requires_grad and not ent.requires_grad
    (upstream * loss).backward()
    return loss.detach(), logp, ent, h.grad, w.grad


def assert_close(name, got, want, rtol, atol):
    got, want = got.float(), want.float()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got - want).abs().max().item()
    bound = atol + rtol * want.abs().max().item()
    assert err <= bound, f"{name}: max abs error {err:.3g} > {bound:.3g}"


def compare(got, want, dtype, n_rows):
    (vr, va), (gr, ga) = TOL[dtype]
    assert_close("loss", got[0], want[0], LOSS_RTOL[dtype], va * n_rows)  # a sum of n_rows per-token losses
    for name, a, b, rtol, atol in zip(("logp", "entropy", "dh", "dW"), got[1:], want[1:], (vr, vr, gr, gr),
                                      (va, va, ga, ga)):
        assert_close(name, a, b, rtol, atol)
    assert got[3].dtype == dtype and got[4].dtype == dtype
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.float32


def check(N, H, V, dtype, temperature, loss_fn=linear, device=DEV, upstream=1.0, **settings):
    hidden, weight, tgt, a, b = make_inputs(N, H, V, dtype, device)
    got = run("fused", hidden, weight, tgt, loss_fn, (a, b), temperature, upstream, **settings)
    want = run("torch", hidden, weight, tgt, loss_fn, (a, b), temperature, upstream)
    compare(got, want, dtype, N)
    ignored = tgt == lp.IGNORE_INDEX
    assert ignored.any() and (got[1][ignored] == 0).all() and (got[2][ignored] == 0).all()
    assert (got[3][ignored] == 0).all(), "ignored rows must get zero gradient"
    return got


# ---- CPU (interpreter) or GPU: tiny shapes ---------------------------------------------------
CASES = [  # N, H, V, dtype, temperature, loss_fn: N and V off the stream kernels' tiles (16 x 32)
    (37, 24, 100, torch.float32, 0.7, linear),
    (20, 16, 65, torch.float32, 1.3, curved),
    (37, 24, 100, torch.bfloat16, 1.0, curved),
    (20, 16, 65, torch.bfloat16, 0.7, linear),
]


@needs_triton
@pytest.mark.parametrize("N,H,V,dtype,temperature,loss_fn", CASES)
def test_matches_reference(N, H, V, dtype, temperature, loss_fn):
    check(N, H, V, dtype, temperature, loss_fn, upstream=3.0)  # backward scales by the upstream gradient


def set_tiles(monkeypatch, rows, sub):
    """Force token_loss's blocks: `rows` rows of dlogits, fp32 logits in sub-blocks of `sub` rows."""
    monkeypatch.setattr(lp, "_loss_tiles", lambda *a, **k: (rows, sub))


@needs_triton
@pytest.mark.parametrize("rows,sub", [(16, 16), (24, 8), (20, 7)])
def test_blocks(rows, sub, monkeypatch):
    # Several blocks of rows (dW summed over them, rounded once per block in bf16) and several logits
    # sub-blocks per block, sizes on and off the stream tiles: bf16 within tolerance of the fp32 reference, fp32
    # equal to the one-block result up to summation order.
    set_tiles(monkeypatch, rows, sub)
    check(50, 16, 70, torch.bfloat16, 0.8, curved)
    hidden, weight, tgt, a, b = make_inputs(50, 16, 70, torch.float32)
    # One CPU thread for the fp32 comparison: with two, the CPU GEMMs split their sums by shape and thread, which
    # moved dh by 1.06e-6 of its largest entry (|dh| up to 5.9e5 from curved's exp(-logp)), past the 1e-6 bound.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        blocked = run("fused", hidden, weight, tgt, curved, (a, b), 0.8)
        set_tiles(monkeypatch, 50, 50)
        one = run("fused", hidden, weight, tgt, curved, (a, b), 0.8)
    finally:
        torch.set_num_threads(threads)
    for name, x, y in zip(("loss", "logp", "entropy", "dh", "dW"), blocked, one):
        assert_close(name, x, y, 1e-6, 1e-6)


@needs_triton
@pytest.mark.parametrize("vchunk", [32, 20, 69])
def test_logits_in_column_chunks(vchunk, monkeypatch):
    # The logits GEMM in chunks of columns, each folded into the running stats right after it (the first chunk
    # fills every V range, a narrower last chunk leaves some ranges as they were), with several sub-blocks: the
    # same loss, log-probs, entropies and gradients as the reference, and in fp32 as one chunk.
    set_tiles(monkeypatch, 24, 8)
    monkeypatch.setattr(lp, "_loss_cfg", lambda hidden, real=lp._loss_cfg: real(hidden) | {"vchunk": vchunk})
    check(50, 16, 70, torch.bfloat16, 0.8, curved)
    hidden, weight, tgt, a, b = make_inputs(50, 16, 70, torch.float32)
    chunked = run("fused", hidden, weight, tgt, curved, (a, b), 0.8)
    monkeypatch.undo()  # token_loss's own settings: all of V in one GEMM
    set_tiles(monkeypatch, 24, 8)
    whole = run("fused", hidden, weight, tgt, curved, (a, b), 0.8)
    for name, x, y in zip(("loss", "logp", "entropy", "dh", "dW"), chunked, whole):
        assert_close(name, x, y, 1e-6, 1e-6)


@needs_triton
def test_bench_sweep_settings_reach_the_kernel(monkeypatch):
    # bench_logprob.py's --loss-sub / --loss-vchunk / --loss-stream rows run token_loss with those settings (GEMMs
    # of vchunk columns counted; tiles smaller than the interpreter's default), values as the reference's.
    bench = importlib.import_module("bench.bench_logprob")
    assert bench.parse_stream("8x16x4x3") == dict(BLOCK_N=8, BLOCK_V=16, num_warps=4, per_sm=3)
    with pytest.raises(SystemExit, match="BLOCK_NxBLOCK_VxWARPSxPER_SM"):
        bench.parse_stream("16x512")
    widths = []
    real_mm = lp._mm_fp32
    monkeypatch.setattr(lp, "_mm_fp32", lambda a, b, out, **k: (widths.append(out.shape[1]), real_mm(a, b, out, **k)))
    hidden, weight, tgt, a, b = make_inputs(40, 16, 70, torch.float32)
    fn = bench.with_tiles(bench.fused_loss(1, curved, (a, b)), 8, 32, "8x16x4x3")
    got = fn(hidden, weight, tgt, 0.9)
    assert widths == [32, 32, 6] * 5  # 5 sub-blocks of 8 rows, 3 GEMMs each
    want = run("torch", hidden, weight, tgt, curved, (a, b), 0.9)
    for name, x, y in zip(("loss", "logp", "entropy"), got, want):
        assert_close(name, x, y, 1e-5, 1e-5 * 40 if name == "loss" else 1e-5)
    assert lp._loss_cfg(hidden)["vchunk"] is None and lp._loss_cfg(hidden)["per_sm"] == 2  # restored


def test_bench_timeline_finds_the_idle_gaps():
    # bench_logprob.py --profile's timeline: overlapping kernels count once, the gaps between them are idle time,
    # listed longest first with the kernels on either side; CPU events are not kernels.
    bench = importlib.import_module("bench.bench_logprob")
    ev = lambda name, s, e, dev="DeviceType.CUDA": types.SimpleNamespace(  # noqa: E731
        name=name, device_type=dev, time_range=types.SimpleNamespace(start=s, end=e))
    events = [ev("gemm", 0, 800), ev("stats", 850, 950), ev("tiny", 900, 960), ev("host op", 0, 5000, "DeviceType.CPU"),
              ev("dlogits", 1960, 2060)]
    out = bench.timeline(events)
    assert out.splitlines()[0].startswith("timeline: span 2.06 ms, kernels busy 1.01 ms, idle 1.05 ms in 2 gaps")
    assert "(1.05 ms in gaps >= 20 us)" in out
    assert out.splitlines()[1].split() == ["gap", "1.000", "ms", "after", "tiny", "before", "dlogits"]
    assert out.splitlines()[2].split()[:6] == ["gap", "0.050", "ms", "after", "gemm", "before"]
    assert bench.timeline([ev("host op", 0, 5, "DeviceType.CPU")]) == "timeline: no GPU kernels recorded"


@needs_triton
def test_zero_terms_and_ignored_rows():
    # Per-token weights 0 (mask 0, zero advantage) on half of the rows, targets -100 on others: those rows get no
    # gradient, the rest matches the reference; with every row ignored, everything is 0.
    N, H, V = 30, 16, 50
    hidden, weight, tgt, a, b = make_inputs(N, H, V, torch.float32, n_masked=5)
    mask = (torch.arange(N, device=DEV) % 2).float()  # (N,)
    fn = lambda logp, ent, a, b, mask: mask * curved(logp, ent, a, b)  # noqa: E731
    got = run("fused", hidden, weight, tgt, fn, (a, b, mask), 1.1)
    want = run("torch", hidden, weight, tgt, fn, (a, b, mask), 1.1)
    compare(got, want, torch.float32, N)
    no_grad = (mask == 0) | (tgt == lp.IGNORE_INDEX)
    assert (got[3][no_grad] == 0).all() and (got[3][~no_grad].abs().sum(1) > 0).all()
    everything_ignored = torch.full((N,), lp.IGNORE_INDEX, device=DEV)
    loss, logp, ent, dh, dw = run("fused", hidden, weight, everything_ignored, linear, (a, b))
    assert loss == 0 and (logp == 0).all() and (ent == 0).all() and (dh == 0).all() and (dw == 0).all()


@needs_triton
@pytest.mark.parametrize("loss_fn", [lambda logp, ent: -logp, lambda logp, ent: ent], ids=["nll", "entropy"])
def test_one_input_used(loss_fn, monkeypatch):
    # Cross-entropy (Liger's loss) and entropy alone: the unused input's derivative is None inside, and the used
    # one's is a broadcast (stride 0) tensor.
    set_tiles(monkeypatch, 16, 8)
    hidden, weight, tgt, _, _ = make_inputs(30, 16, 50, torch.float32)
    compare(run("fused", hidden, weight, tgt, loss_fn, ()), run("torch", hidden, weight, tgt, loss_fn, ()),
            torch.float32, 30)


@needs_triton
def test_tied_embedding():
    # The LM head is the input embedding: autograd adds the head's dW (computed in the forward) to the lookup's.
    V, H, N = 60, 16, 24
    hidden, weight, tgt, a, b = make_inputs(N, H, V, torch.float32)
    ids = torch.randint(0, V, (N,), device=DEV)
    grads = []
    for impl in ("fused", "torch"):
        emb = torch.nn.Parameter(weight.clone())
        h = torch.tanh(torch.nn.functional.embedding(ids, emb) + hidden)  # (N, H)
        loss, _, _ = lp.token_loss(h, emb, tgt, curved, (a, b), 0.9, impl=impl)
        loss.backward()
        grads.append(emb.grad)
    assert_close("tied dW", grads[0], grads[1], 1e-5, 1e-6)


def grpo_token_loss(logp, entropy, adv, old_logp, ref_logp, tis_w, weight, args):
    """GRPO's per-token loss (grpo.py:policy_loss): clipped surrogate (x truncated-IS weight) + kl_coef * KL -
    entropy_coef * H, times the token's share of the aggregation (mask / normaliser, or / sequence length)."""
    pg, _ = grpo.clipped_pg_loss(logp[:, None], old_logp[:, None], adv, args.clip_eps_low, args.clip_eps_high)
    loss_tok = pg[:, 0] * tis_w + args.kl_coef * grpo.kl_penalty(logp, ref_logp, args.kl_estimator)
    return (loss_tok - args.entropy_coef * entropy) * weight


@needs_triton
@pytest.mark.parametrize("loss_agg,dtype", [("token-mean", torch.float32), ("seq-mean-token-mean", torch.bfloat16)])
def test_grpo_policy_loss(loss_agg, dtype, monkeypatch):
    # GRPO's loss through token_loss equals grpo.policy_loss on the reference log-probs, value and gradients: prompt
    # tokens ignored (target -100), padding in the loss mask only, a group of zero advantage, tokens on
    # the clipped and the unclipped branch, k3 KL, entropy bonus, truncated IS.
    B, T, H, V = 4, 12, 16, 70
    set_tiles(monkeypatch, 16, 8)  # several blocks
    hidden, weight, tgt, _, _ = make_inputs(B * T, H, V, dtype, n_masked=0)
    g = torch.Generator().manual_seed(1)
    tgt.view(B, T)[:, :3] = lp.IGNORE_INDEX  # prompt
    mask = (tgt != lp.IGNORE_INDEX).float().view(B, T)  # (B, T)
    mask[1, -4:] = 0  # padding after the end: a target, but out of the loss
    adv = torch.tensor([1.0, -0.5, 0.0, 2.0], device=DEV)  # (B,)
    args = grpo.Args(kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0, loss_agg=loss_agg, max_new_tokens=T)
    ref_lp, ref_ent = lp.logprob_reference(hidden.float(), weight.float(), tgt, 1.0)  # (B*T,)
    old_logp = (ref_lp + 0.4 * torch.randn(B * T, generator=g).to(DEV)).view(B, T)  # ratios beyond 1 +- 0.2
    ref_logp = (ref_lp + 0.3 * torch.randn(B * T, generator=g).to(DEV)).view(B, T)
    engine_logp = (old_logp + 0.5 * torch.randn(B, T, generator=g).to(DEV))  # some TIS weights capped
    normaliser = grpo.loss_normaliser(mask, loss_agg, T)
    _, clipped = grpo.clipped_pg_loss(ref_lp.view(B, T), old_logp, adv, args.clip_eps_low, args.clip_eps_high)
    assert 0 < (clipped * mask).sum() < mask.sum(), "the test needs tokens on both branches"

    # reference: grpo.py's own loss on the fp32 reference
    h = hidden.detach().float().requires_grad_()
    w = weight.detach().float().requires_grad_()
    logp, ent = lp.token_logprobs(h, w, tgt, 1.0, impl="torch")
    want, _ = grpo.policy_loss(logp.view(B, T), ent.view(B, T), mask, adv, old_logp, ref_logp, engine_logp, args,
                               normaliser)
    want.backward()

    # fused: the same loss as per-token constants
    tis_w = torch.exp(old_logp - engine_logp).clamp(max=args.tis_cap)  # (B, T)
    weight_tok = mask / normaliser  # (B, T): token-mean and seq-mean-token-sum
    if loss_agg == "seq-mean-token-mean":
        weight_tok = weight_tok / mask.sum(1, keepdim=True).clamp(min=1)
    token_args = [x.flatten() for x in (adv[:, None].expand(B, T), old_logp, ref_logp, tis_w, weight_tok)]
    h2 = hidden.detach().clone().requires_grad_()
    w2 = weight.detach().clone().requires_grad_()
    loss, logp2, ent2 = lp.token_loss(h2, w2, tgt, grpo_token_loss, (*token_args, args), 1.0, impl="fused")
    loss.backward()
    (vr, va), (gr, ga) = TOL[dtype]
    assert_close("loss", loss, want, vr, va * B * T)
    assert_close("logp", logp2, logp, vr, va)
    assert_close("entropy", ent2, ent, vr, va)
    assert_close("dh", h2.grad, h.grad, gr, ga)
    assert_close("dW", w2.grad, w.grad, gr, ga)
    assert (h2.grad.view(B, T, H)[mask == 0] == 0).all()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_scale_pass(dtype):
    scale_check("cpu", dtype)


@pytest.mark.gpu
@gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_scale_pass_gpu(dtype):
    scale_check("cuda", dtype)


def scale_check(dev, dtype):
    # token_loss's backward scales dh and dW by the upstream gradient in place with a Triton pass (torch's mul_ by a
    # 0-dim fp32 tensor is slow for bf16 on the GPU): products in fp32, rounded once (to nearest on the GPU: exactly
    # torch's product; Triton's interpreter truncates: within one bf16 step), a length not a multiple of the block.
    if dev == "cpu" and not lp._interpreting():
        pytest.skip("a GPU machine compiles the kernels: the GPU test runs the pass")
    x = torch.randn(100_000 + 7, generator=torch.Generator().manual_seed(0)).to(dev, dtype)
    g = torch.tensor(-2.75, device=dev)
    want = (x.float() * g).to(dtype)
    y = x.clone()
    lp._scale_(y, g)
    exact = dtype == torch.float32 or (dev == "cuda" and not lp._interpreting())
    torch.testing.assert_close(y, want, atol=0, rtol=0 if exact else 2**-7)
    assert (y != x).float().mean() > 0.99  # every element was scaled, the tail included
    z = y.clone()
    lp._scale_(z, torch.tensor(1.0, device=dev))
    assert torch.equal(z, y)


@needs_triton
def test_grad_modes():
    # No gradient wanted (no_grad, or inputs without requires_grad): the loss alone, no dlogits. Only hidden or only
    # weight: that gradient alone. A second backward through one call is refused.
    hidden, weight, tgt, a, b = make_inputs(20, 16, 40, torch.float32)
    want = run("torch", hidden, weight, tgt, curved, (a, b))
    with torch.no_grad():
        loss, logp, _ = lp.token_loss(hidden.requires_grad_(), weight, tgt, curved, (a, b), impl="fused")
    assert_close("no_grad loss", loss, want[0], 1e-5, 1e-4)
    assert not loss.requires_grad
    hidden.requires_grad_(False)
    for h_grad in (True, False):
        h = hidden.clone().requires_grad_(h_grad)
        w = weight.clone().requires_grad_(not h_grad)
        loss, _, _ = lp.token_loss(h, w, tgt, curved, (a, b), impl="fused")
        loss.backward(retain_graph=True)
        got, ref = (h.grad, want[3]) if h_grad else (w.grad, want[4])
        assert (w.grad is None) == h_grad and (h.grad is None) != h_grad
        assert_close("dh" if h_grad else "dW", got, ref, 1e-5, 1e-5)
        with pytest.raises(RuntimeError, match="second backward"):
            loss.backward()


@needs_triton
def test_bad_input():
    hidden, weight, tgt, a, b = make_inputs(6, 8, 10, torch.float32)
    with pytest.raises(ValueError, match=r"loss_fn must return the per-token loss, a tensor of shape \(6,\)"):
        lp.token_loss(hidden, weight, tgt, lambda logp, ent: logp.mean(), impl="fused")
    with pytest.raises(ValueError, match=r"token_args\[1\] has shape \(2, 3\); per-token arguments must be \(6,\)"):
        lp.token_loss(hidden, weight, tgt, linear, (a, b.view(2, 3)), impl="fused")
    with pytest.raises(ValueError, match=r"token_args\[1\] is on meta, hidden on (cpu|cuda)"):
        lp.token_loss(hidden, weight, tgt, linear, (a, b.to("meta")), impl="fused")
    with pytest.raises(ValueError, match=r"token_args\[0\] requires grad"):
        lp.token_loss(hidden, weight, tgt, linear, (a.requires_grad_(), b), impl="fused")
    with pytest.raises(ValueError, match="workspace_mb must be positive"):
        lp.token_loss(hidden, weight, tgt, linear, (a.detach(), b), impl="fused", workspace_mb=0)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        lp.token_loss(hidden, weight, tgt, "token-mean")


DEFAULT_BUDGET = inspect.signature(lp.token_loss).parameters["workspace_mb"].default << 20


def test_workspace_budget():
    # Bench shape (Qwen2.5-7B head, 32k tokens, bf16): the fp32 logits sub-block and the bf16 dlogits block stay
    # under the default budget (the one token_logprobs has) and under 2% of the fp32 logits; blocks of rows a
    # multiple of the logits sub-block, both multiples of 128.
    N, V = 32768, 152064  # H = 3584 sets no block here: the dlogits GEMMs run over all of V
    assert DEFAULT_BUDGET == inspect.signature(lp.token_logprobs).parameters["workspace_mb"].default << 20
    rows, sub = lp._loss_tiles(N, V, 2, DEFAULT_BUDGET, 128)
    ws = sub * V * 4 + rows * V * 2
    assert ws <= DEFAULT_BUDGET and ws < 0.02 * N * V * 4, (rows, sub, ws)
    assert rows % sub == 0 and sub % 128 == 0 and sub >= 128 and -(-N // rows) <= 64
    rows, sub = lp._loss_tiles(N, V, 2, 2048 << 20, 128)  # a larger budget: fewer, larger blocks
    assert sub * V * 4 + rows * V * 2 <= 2048 << 20 and -(-N // rows) <= 8
    assert lp._loss_tiles(100, 1000, 2, DEFAULT_BUDGET, 128) == (100, 100)  # small problem: one block


def test_sub_blocks_follow_the_hidden_size():
    # With the hidden size (CUDA), sub-blocks keep rows x H >= 256 x 3584 where their fp32 logits fit in half the
    # budget: the 7B head keeps 256 rows; a 0.5B head (H 896) gets 1024 rows in the scripts' 1536 MB fused-loss
    # workspace and falls back to 256 in 320 MB; without it (CPU, the interpreter), the fixed rule.
    V7, V05, MB = 152064, 151936, 1 << 20
    assert lp._loss_tiles(32768, V7, 2, 1536 * MB, 128, hidden_size=3584)[1] == 256
    rows, sub = lp._loss_tiles(16384, V05, 2, 1536 * MB, 128, hidden_size=896)
    assert sub == 1024 and rows % sub == 0 and sub * V05 * 4 + rows * V05 * 2 <= 1536 * MB
    assert lp._loss_tiles(16384, V05, 2, 320 * MB, 128, hidden_size=896) == lp._loss_tiles(16384, V05, 2, 320 * MB, 128)
    assert lp._loss_tiles(16384, V05, 2, 320 * MB, 128)[1] == 256
    assert lp._loss_tiles(8192, 49152, 2, 1536 * MB, 128, hidden_size=576)[1] == 1664  # SmolLM2's head
    assert lp._loss_tiles(16384, V05, 2, 1536 * MB, 128, sub=512, hidden_size=896)[1] == 512  # a forced sub wins
    assert inspect.signature(TokenLogProbs).parameters["loss_workspace_mb"].default == 1536


# ---- GPU: large shapes -----------------------------------------------------------------------
GPU_CASES = [
    (4096, 3584, 151936, torch.bfloat16, 0.7),
    (1000, 896, 152063, torch.bfloat16, 1.0),  # N and V off every block size
    (2048, 1024, 32001, torch.float32, 1.3),
]


@needs_triton
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,H,V,dtype,temperature", GPU_CASES)
def test_gpu_matches_reference(N, H, V, dtype, temperature):
    torch.backends.cuda.matmul.allow_tf32 = False
    check(N, H, V, dtype, temperature, curved, device="cuda", upstream=2.0)


@needs_triton
@pytest.mark.gpu
@gpu
def test_gpu_blocks():
    rows, sub = lp._loss_tiles(1500, 50000, 2, 64 << 20, 128)  # several blocks and sub-blocks
    assert rows < 1500 and sub < rows
    check(1500, 512, 50000, torch.bfloat16, 1.0, curved, device="cuda", workspace_mb=64)


@needs_triton
@pytest.mark.gpu
@gpu
def test_gpu_sub_blocks_at_a_small_hidden_size(monkeypatch):
    # A 0.5B model's head in the scripts' fused-loss workspace: 1024-row sub-blocks, two per block of 2048 rows
    chosen, real = [], lp._loss_tiles
    monkeypatch.setattr(lp, "_loss_tiles", lambda *a, **k: chosen.append(real(*a, **k)) or chosen[-1])
    check(4096, 896, 151936, torch.bfloat16, 1.0, curved, device="cuda", workspace_mb=1536)
    assert chosen == [(2048, 1024)]


@needs_triton
@pytest.mark.gpu
@gpu
def test_gpu_logits_in_column_chunks(monkeypatch):
    # cuBLAS writing fp32 logits into column slices of the sub-block buffer (rows V apart), a narrower last chunk
    monkeypatch.setattr(lp, "_loss_cfg", lambda hidden, real=lp._loss_cfg: real(hidden) | {"vchunk": 16384})
    check(1500, 512, 50000, torch.bfloat16, 1.0, curved, device="cuda", workspace_mb=64)


@needs_triton
@pytest.mark.gpu
@gpu
def test_gpu_workspace_within_budget():
    # Peak memory of forward + backward above the inputs and the gradients stays within the budget (+ 5% and 48 MB
    # for (N,) vectors, the allocator's rounding and cuBLAS's workspace).
    budget = 128 << 20
    hidden, weight, tgt, a, b = make_inputs(8192, 2048, 65536, torch.bfloat16, "cuda")
    h = hidden.requires_grad_()
    w = weight.requires_grad_()

    def fwd_bwd():
        loss, _, _ = lp.token_loss(h, w, tgt, curved, (a, b), impl="fused", workspace_mb=budget >> 20)
        loss.backward()

    fwd_bwd()  # compiles, allocates cuBLAS's workspace
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    workspace = torch.cuda.max_memory_allocated() - base - h.numel() * 2 - w.numel() * 2
    assert workspace <= budget * 1.05 + (48 << 20), workspace / 2**20
