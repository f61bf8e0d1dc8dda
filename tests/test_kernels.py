"""kernels/logprob.py: the fused (Triton) path against the pure-torch fp32 reference.

Without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1, tiny shapes, whole file
well under a minute on 2 cores). Tests marked gpu run large shapes on CUDA.
"""

import importlib
import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads TRITON_INTERPRET when a kernel is decorated: when kernels.logprob is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels.logprob as lp  # noqa: E402

HAS_TRITON = lp.HAS_TRITON
if HAS_TRITON and not torch.cuda.is_available() and lp._interpreting():
    # kernels.logprob may have been imported (compiled mode) by an earlier test module.
    if type(lp._fwd_kernel).__name__ != "InterpretedFunction":
        lp = importlib.reload(lp)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
VARIANTS = ["triton", "cublas"]


@pytest.fixture(params=VARIANTS)
def variant(request):
    """Run the test with each way of computing the logits (token_logprobs(..., variant=))."""
    return request.param


def set_tiles(monkeypatch, fwd, bwd):
    """Force the (rows, cols) blocks of the cublas forward and of the backward."""
    monkeypatch.setattr(lp, "_fwd_tiles", lambda *a: fwd)
    monkeypatch.setattr(lp, "_bwd_tiles", lambda *a: bwd)


def make_inputs(N, H, V, dtype, device=DEV, scale=1.0, seed=0, n_masked=2):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = (torch.randn(N, H, generator=g) * scale).to(device=device, dtype=dtype)  # (N, H)
    weight = (torch.randn(V, H, generator=g) / H**0.5 * 2).to(device=device, dtype=dtype)  # (V, H)
    targets = torch.randint(0, V, (N,), generator=g)  # (N,)
    targets[torch.randperm(N, generator=g)[:n_masked]] = lp.IGNORE_INDEX
    g_lp = torch.randn(N, generator=g).to(device)  # (N,) upstream gradients
    g_ent = torch.randn(N, generator=g).to(device)  # (N,)
    return hidden, weight, targets.to(device), g_lp, g_ent


def run(impl, hidden, weight, targets, temperature, g_lp, g_ent, **settings):
    """Outputs and (dh, dW) through both outputs with the given upstream gradients; settings: the
    kernel's (variant, workspace_mb, tune)."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    logp, ent = lp.token_logprobs(h, w, targets, temperature, impl=impl, **settings)
    (logp * g_lp + ent * g_ent).sum().backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def reference(hidden, weight, targets, temperature, g_lp, g_ent):
    """fp32 reference on fp32 copies of the inputs (the ground truth for bf16 too)."""
    logp, ent, dh, dw = run("torch", hidden.float(), weight.float(), targets, temperature,
                            g_lp, g_ent)
    return logp, ent, dh, dw


def assert_close(name, got, want, rtol, atol):
    got, want = got.float(), want.float()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got - want).abs().max().item()
    bound = atol + rtol * want.abs().max().item()
    assert err <= bound, f"{name}: max abs error {err:.3g} > {bound:.3g}"


TOL = {  # (values rtol, atol), (gradients rtol, atol): bf16 rounds dlogits and the gradients
    torch.float32: ((1e-5, 1e-5), (1e-5, 1e-5)),
    torch.bfloat16: ((1e-5, 1e-4), (2e-2, 1e-3)),
}


def check(N, H, V, dtype, temperature, scale=1.0, device=DEV, targets=None, seed=0, **settings):
    hidden, weight, tgt, g_lp, g_ent = make_inputs(N, H, V, dtype, device, scale, seed)
    if targets is not None:
        tgt = targets
    got = run("fused", hidden, weight, tgt, temperature, g_lp, g_ent, **settings)
    want = reference(hidden, weight, tgt, temperature, g_lp, g_ent)
    (vr, va), (gr, ga) = TOL[dtype]
    # Logits of magnitude L carry fp32 rounding of about L * 1e-7 in either implementation.
    va = max(va, 2e-6 * scale * H**0.5)
    gr = max(gr, 1e-4) if scale > 1 else gr  # float64 check: both paths err ~1e-5 relative here
    for name, a, b, rtol, atol in zip(("logp", "entropy", "dh", "dW"), got, want,
                                      (vr, vr, gr, gr), (va, va, ga, ga)):
        assert_close(name, a, b, rtol, atol)
    assert got[2].dtype == dtype and got[3].dtype == dtype
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    masked = tgt == lp.IGNORE_INDEX
    assert (got[0][masked] == 0).all() and (got[1][masked] == 0).all()
    assert (got[2][masked] == 0).all(), "ignored rows must get zero gradient"
    return hidden, weight, tgt, got


# ---- CPU (interpreter) or GPU: tiny shapes ---------------------------------------------------
CASES = [  # N, H, V, dtype, temperature: V and N off the block sizes (16 x 32 x 16), H small
    (64, 64, 300, torch.float32, 1.0),
    (37, 40, 257, torch.float32, 0.7),
    (5, 16, 33, torch.float32, 1.3),
    (16, 32, 64, torch.float32, 1.0),
    (64, 64, 300, torch.bfloat16, 1.3),
    (37, 40, 257, torch.bfloat16, 1.0),
    (20, 24, 100, torch.bfloat16, 0.7),
]


@needs_triton
@pytest.mark.parametrize("N,H,V,dtype,temperature", CASES)
def test_matches_reference(N, H, V, dtype, temperature, variant):
    check(N, H, V, dtype, temperature, variant=variant)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_logits_stay_finite(dtype, variant):
    # hidden x 50: logits in the hundreds, most probabilities underflow to 0.
    check(32, 32, 200, dtype, 1.0, scale=50.0, variant=variant)


@needs_triton
def test_unlikely_targets(variant):
    hidden, weight, _, _, _ = make_inputs(24, 32, 150, torch.float32, scale=8.0)
    logits = hidden @ weight.t()
    tgt = logits.argmin(-1)  # log-probs of about -100
    tgt[0] = lp.IGNORE_INDEX
    _, _, _, got = check(24, 32, 150, torch.float32, 1.0, scale=8.0, targets=tgt, variant=variant)
    assert got[0][1:].max() < -20


@needs_triton
def test_all_rows_ignored(variant):
    hidden, weight, _, g_lp, g_ent = make_inputs(8, 16, 40, torch.float32)
    tgt = torch.full((8,), lp.IGNORE_INDEX, device=DEV)
    logp, ent, dh, dw = run("fused", hidden, weight, tgt, 1.0, g_lp, g_ent, variant=variant)
    assert (logp == 0).all() and (ent == 0).all() and (dh == 0).all() and (dw == 0).all()


@needs_triton
@pytest.mark.parametrize("which", ["logp", "entropy"])
def test_one_output_used(which, variant):
    # Only one output in the loss: the other's upstream gradient is None inside backward.
    hidden, weight, tgt, _, _ = make_inputs(16, 16, 70, torch.float32)
    grads = []
    for impl in ("fused", "torch"):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        logp, ent = lp.token_logprobs(h, w, tgt, 0.9, impl=impl, variant=variant)
        (logp if which == "logp" else ent).sum().backward()
        grads.append((h.grad, w.grad))
    for a, b in zip(*grads):
        assert_close(which, a, b, 1e-5, 1e-6)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fwd,bwd", [((16, 32), (16, 32)), ((13, 40), (20, 23)), ((50, 16), (48, 90))])
def test_blocks(dtype, fwd, bwd, variant, monkeypatch):
    # Several row blocks and column chunks, sizes on and off the kernels' tiles (16 x 32): the cublas
    # forward merges stats across column chunks; the backward sums dh over column chunks in fp32 and
    # dW over row blocks (one rounding each in bf16).
    set_tiles(monkeypatch, fwd, bwd)
    check(50, 32, 90, dtype, 0.8, variant=variant)


@needs_triton
@pytest.mark.parametrize("fwd,bwd", [((16, 32), (16, 32)), ((64, 90), (64, 90))])
def test_blocking_does_not_change_results(fwd, bwd, variant, monkeypatch):
    # fp32: the blocked result equals the one-block result up to fp32 summation order.
    hidden, weight, tgt, g_lp, g_ent = make_inputs(50, 32, 90, torch.float32)
    set_tiles(monkeypatch, (64, 90), (64, 90))
    one = run("fused", hidden, weight, tgt, 1.0, g_lp, g_ent, variant=variant)
    set_tiles(monkeypatch, fwd, bwd)
    blocked = run("fused", hidden, weight, tgt, 1.0, g_lp, g_ent, variant=variant)
    for name, a, b in zip(("logp", "entropy", "dh", "dW"), blocked, one):
        assert_close(name, a, b, 1e-6, 1e-6)


@needs_triton
def test_dh_only_and_dw_only(variant, monkeypatch):
    # Only one input needs a gradient: the backward skips the other GEMM and its buffers.
    set_tiles(monkeypatch, (16, 32), (16, 32))
    hidden, weight, tgt, g_lp, g_ent = make_inputs(40, 16, 70, torch.bfloat16)
    _, _, dh_ref, dw_ref = reference(hidden, weight, tgt, 1.0, g_lp, g_ent)
    for h_grad in (True, False):
        h = hidden.clone().requires_grad_(h_grad)
        w = weight.clone().requires_grad_(not h_grad)
        logp, ent = lp.token_logprobs(h, w, tgt, 1.0, impl="fused", variant=variant)
        (logp * g_lp + ent * g_ent).sum().backward()
        got, want = (h.grad, dh_ref) if h_grad else (w.grad, dw_ref)
        assert (w.grad is None) == h_grad and (h.grad is None) != h_grad
        assert_close("dh" if h_grad else "dW", got, want, 2e-2, 1e-3)


DEFAULT_BUDGET = inspect.signature(lp.token_logprobs).parameters["workspace_mb"].default << 20


def test_workspace_budget():
    # Bench shape (Qwen2.5-7B head, 32k tokens, bf16): the backward's workspace (fp32 dh accumulator +
    # logits and dlogits blocks) stays under the default budget and under 2% of the fp32 logits; dW
    # is rounded at most 5 times; the blocks are large enough for efficient GEMMs.
    N, H, V = 32768, 3584, 152064
    for elt in (2, 6):  # triton variant: bf16 dlogits; cublas: + fp32 logits
        rows, cols = lp._bwd_tiles(N, V, H, elt, DEFAULT_BUDGET, 128)
        ws = rows * H * 4 + rows * cols * elt
        assert ws <= DEFAULT_BUDGET and ws < 0.02 * N * V * 4, (rows, cols, ws)
        assert -(-N // rows) <= 5 and rows % 128 == 0 and cols % 128 == 0 and cols >= 4096
    rows, cols = lp._fwd_tiles(N, V, DEFAULT_BUDGET, 128)
    assert rows * cols * 4 <= DEFAULT_BUDGET and rows == N and cols >= 2048
    # Small problems: one block each way, nothing above the problem size.
    assert lp._bwd_tiles(100, 1000, 64, 6, DEFAULT_BUDGET, 128) == (100, 1000)
    assert lp._fwd_tiles(100, 1000, DEFAULT_BUDGET, 128) == (100, 1000)
    assert lp._split(1000, 300, 16) == 256 and lp._split(1000, 1000, 16) == 1000


@needs_triton
def test_bad_settings():
    hidden, weight, tgt, _, _ = make_inputs(4, 8, 10, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="variant must be 'triton' or 'cublas', got 'cutlass'"):
        lp.token_logprobs(hidden, weight, tgt, impl="fused", variant="cutlass")
    with pytest.raises(ValueError, match="workspace_mb must be positive"):
        lp.token_logprobs(hidden, weight, tgt, impl="fused", workspace_mb=0)


@needs_triton
def test_settings_are_arguments(monkeypatch):
    # The kernel's settings reach the code they select, per call (no module state): the variant picks
    # the forward, workspace_mb sets the tiles' budget; the defaults are cublas and 320 MB.
    seen = []
    for name in ("_fwd_tiles", "_bwd_tiles"):
        real = getattr(lp, name)
        monkeypatch.setattr(lp, name, lambda *a, real=real, name=name: seen.append((name, a[-2])) or real(*a))
    for name in ("_cublas_forward", "_fused_forward"):
        real = getattr(lp, name)
        monkeypatch.setattr(lp, name, lambda *a, real=real, name=name: seen.append((name,)) or real(*a))
    hidden, weight, tgt, g_lp, g_ent = make_inputs(20, 16, 40, torch.float32)
    run("fused", hidden, weight, tgt, 1.0, g_lp, g_ent)
    assert seen == [("_cublas_forward",), ("_fwd_tiles", 320 << 20), ("_bwd_tiles", 320 << 20)]
    seen.clear()
    run("fused", hidden, weight, tgt, 1.0, g_lp, g_ent, variant="triton", workspace_mb=7)
    assert seen == [("_fused_forward",), ("_bwd_tiles", 7 << 20)]


@needs_triton
def test_tied_embedding(variant):
    # The LM head reuses the input embedding: autograd sums d(embedding lookup) and d(head).
    V, H, N = 120, 32, 24
    hidden, weight, tgt, g_lp, g_ent = make_inputs(N, H, V, torch.float32)
    ids = torch.randint(0, V, (N,), device=DEV)
    grads = []
    for impl in ("fused", "torch"):
        emb = torch.nn.Parameter(weight.clone())
        h = torch.tanh(torch.nn.functional.embedding(ids, emb) + hidden)  # (N, H)
        logp, ent = lp.token_logprobs(h, emb, tgt, 1.0, impl=impl, variant=variant)
        (logp * g_lp + ent * g_ent).sum().backward()
        grads.append(emb.grad)
    assert_close("tied dW", grads[0], grads[1], 1e-5, 1e-6)


def test_auto_and_bad_impl():
    hidden, weight, tgt, _, _ = make_inputs(4, 8, 10, torch.float32, device="cpu")
    if not lp._interpreting():  # auto is torch on CPU
        a = lp.token_logprobs(hidden, weight, tgt)
        b = lp.logprob_reference(hidden, weight, tgt)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError):
        lp.token_logprobs(hidden, weight, tgt, impl="cuda")


def test_reference_by_hand():
    # Two tokens, logits [0, log 3]: p = [1/4, 3/4].
    hidden = torch.tensor([[1.0], [1.0]])
    weight = torch.tensor([[0.0], [torch.log(torch.tensor(3.0)).item()]])
    tgt = torch.tensor([1, lp.IGNORE_INDEX])
    logp, ent = lp.logprob_reference(hidden, weight, tgt)
    p = torch.tensor([0.25, 0.75])
    assert torch.allclose(logp, torch.tensor([p[1].log().item(), 0.0]))
    assert torch.allclose(ent, torch.tensor([-(p * p.log()).sum().item(), 0.0]))


# ---- GPU: large shapes -----------------------------------------------------------------------
GPU_CASES = [
    (4096, 4096, 152064, torch.bfloat16, 1.0),
    (4096, 3584, 151936, torch.bfloat16, 0.7),
    (1000, 896, 152063, torch.bfloat16, 1.3),  # N and V off every block size
    (777, 64, 50257, torch.bfloat16, 1.0),
    (2048, 1024, 32001, torch.float32, 1.0),
    (300, 100, 1000, torch.float32, 0.7),
]


@needs_triton
@pytest.mark.parametrize("N,H,V,dtype,temperature", GPU_CASES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_matches_reference(N, H, V, dtype, temperature, variant):
    torch.backends.cuda.matmul.allow_tf32 = False
    check(N, H, V, dtype, temperature, device="cuda", variant=variant)


@needs_triton
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_large_logits_and_blocks(variant):
    rows, cols = lp._bwd_tiles(1500, 50000, 512, 6, 4 << 20, 128)  # 4 MB: several row blocks and column chunks
    assert rows < 1500 and cols < 50000
    check(1500, 512, 50000, torch.bfloat16, 1.0, device="cuda", scale=50.0, variant=variant, workspace_mb=4)


@needs_triton
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_workspace_within_budget(variant):
    # Peak memory of forward + backward above inputs and gradients stays within the budget (+ 5% and
    # 48 MB for (N,) vectors, the allocator's rounding and cuBLAS's workspace).
    budget = 128 << 20
    hidden, weight, tgt, g_lp, g_ent = make_inputs(8192, 2048, 65536, torch.bfloat16, "cuda")
    h = hidden.requires_grad_()
    w = weight.requires_grad_()

    def fwd_bwd():
        logp, ent = lp.token_logprobs(h, w, tgt, 1.0, impl="fused", variant=variant, workspace_mb=budget >> 20)
        (logp * g_lp + ent * g_ent).sum().backward()

    fwd_bwd()  # compiles, tunes, allocates cuBLAS's workspace
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    workspace = torch.cuda.max_memory_allocated() - base - h.numel() * 2 - w.numel() * 2
    assert workspace <= budget * 1.05 + (48 << 20), workspace / 2**20
