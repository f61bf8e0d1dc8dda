"""Selected-token log-probabilities and entropies of an LM head, without the (N, V) logits.

    logp, entropy = token_logprobs(hidden, weight, targets, temperature=1.0, impl="auto")

hidden (N, H) and weight (V, H) in bf16 or fp32, targets (N,) long; outputs (N,) fp32. Rows whose
target is -100 give 0 and no gradient. Both outputs are differentiable in hidden and weight (the
weight may be tied to the input embedding: we return dW and autograd accumulates it).

Math
----
z = hidden @ weight.T / T                      (N, V) logits, fp32 accumulation, never stored whole
lse = log sum_j exp(z_j)                         online over chunks of V (flash-attention style):
    running max m, s = sum_j exp(z_j - m), a = sum_j exp(z_j - m) (z_j - m); a new chunk with
    max m' rescales  s <- s e^(m - m') ,  a <- e^(m - m') (a + s (m - m'))  and adds its own terms.
logp    = z_t - lse                            (t = target)
entropy = -sum_j p_j log p_j = lse - sum_j p_j z_j = log s - a / s
    (written relative to m, so logits of magnitude 1e4 lose no precision to cancellation).
Disjoint V ranges are reduced by different programs and merged with the same rescaling.

Backward, upstream gradients g_lp and g_ent (N,), p = softmax(z):
    d logp / d z_j = 1[j = t] - p_j
    d H / d z_j    = d/dz_j (lse - sum_i p_i z_i) = p_j - p_j - sum_i z_i dp_i/dz_j
                   = -p_j (z_j - sum_i p_i z_i) = -p_j (log p_j + H)      (log p_j = z_j - lse)
    dz = g_lp (onehot_t - p) - g_ent p (log p + H);   dlogits (w.r.t. h W^T) = dz / T
    dh = dlogits @ W        dW = dlogits^T @ h
Only lse and H (N,) fp32 are saved; the backward recomputes z.

Implementation choices (impl="fused", Triton)
---------------------------------------------
Forward: one kernel, a GEMM with an online-softmax epilogue. Program = (block of BLOCK_N rows,
range of V); it loops over BLOCK_V chunks of its range and over H in BLOCK_K steps (tl.dot, fp32
accumulate), and writes (N,) partial stats per V range; a few (S, N) torch ops merge them.
Splitting V keeps the GPU full at small N, and programs are launched in groups (GROUP_N row blocks
x all V ranges) so that the h and W tiles in flight fit in L2, as a tiled GEMM's grouped order does.

Backward: in chunks of rows (at most _BWD_CHUNK_BYTES of dlogits), a Triton GEMM kernel recomputes
the logits tile by tile and writes dlogits (rows, V) in the input dtype straight from registers;
then cuBLAS does dh[rows] = dlogits @ W and dW += dlogits^T @ h[rows] (fp32 accumulator across
chunks). Why not keep everything in registers: a program owning dh rows must hold a (BLOCK_N, H)
accumulator (917 KB at H = 3584) or recompute the logits once per H slice; one kernel for dh and
another for dW costs 5 GEMMs instead of 4; atomics cost N H V / BLOCK_V read-modify-writes (about
1 TB at N = 32k, V = 152k). A bounded dlogits buffer costs 4 GEMMs (3 on cuBLAS) plus streaming it.
Any design that recomputes logits needs 4 GEMMs against the 3 of a plain matmul forward+backward,
so fwd+bwd is at least 4/3 of the bare-matmul floor.
"""

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: impl="torch" still works
    HAS_TRITON = False

IGNORE_INDEX = -100
# Largest dlogits buffer the backward materialises at once (LOGPROB_BWD_CHUNK_MB to trade speed for memory), and
# whether dW is accumulated across row chunks in fp32 (default, exact) or in the weight's dtype (LOGPROB_DW_ACCUM=
# output: no V x H fp32 buffer, one rounding per chunk, as Liger-Kernel does). Measured settings: docs/kernels.md.
_BWD_CHUNK_BYTES = int(os.environ.get("LOGPROB_BWD_CHUNK_MB", "2048")) << 20
_DW_ACCUM_FP32 = os.environ.get("LOGPROB_DW_ACCUM", "fp32") != "output"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# ---------------------------------------------------------------------------------------------
# Pure-torch fp32 reference
# ---------------------------------------------------------------------------------------------
def logprob_reference(hidden, weight, targets, temperature: float = 1.0):
    """fp32 reference: upcast, full logits, log_softmax, gather, entropy. Memory O(N V)."""
    logits = hidden.float() @ weight.float().t() / temperature  # (N, V)
    logp_all = torch.log_softmax(logits, dim=-1)  # (N, V)
    valid = targets != IGNORE_INDEX  # (N,)
    logp = logp_all.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)  # (N,)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (N,)
    zero = logp.new_zeros(())
    return torch.where(valid, logp, zero), torch.where(valid, entropy, zero)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _logits_tile(h_ptr, w_ptr, offs_n, offs_v, row_ok, col_ok, H: tl.constexpr, stride_hn,
                     stride_hh, stride_wv, stride_wh, inv_temp,
                     BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """(BLOCK_N, BLOCK_V) fp32 tile of h @ W^T / T."""
        offs_k = tl.arange(0, BLOCK_K)
        h_ptrs = h_ptr + offs_n[:, None].to(tl.int64) * stride_hn + offs_k[None, :] * stride_hh
        w_ptrs = w_ptr + offs_v[:, None].to(tl.int64) * stride_wv + offs_k[None, :] * stride_wh
        acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if EVEN_K:
                hb = tl.load(h_ptrs, mask=row_ok[:, None], other=0.0)
                wb = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
            else:
                k_ok = (k0 + offs_k) < H
                hb = tl.load(h_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                wb = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:  # the interpreter's bf16 tl.dot is wrong (triton 3.6); fp32 is exact here
                hb = hb.to(tl.float32)
                wb = wb.to(tl.float32)
            acc = tl.dot(hb, tl.trans(wb), acc, input_precision=INPUT_PRECISION)
            h_ptrs += BLOCK_K * stride_hh
            w_ptrs += BLOCK_K * stride_wh
        return acc * inv_temp

    @triton.jit
    def _fwd_kernel(h_ptr, w_ptr, tgt_ptr, part_ptr, N, V, H: tl.constexpr, cols_per_split,
                    CHUNKS: tl.constexpr, S, inv_temp,
                    stride_hn, stride_hh, stride_wv, stride_wh,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_N: tl.constexpr, EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                    UPCAST: tl.constexpr):
        """Partial max, sum exp, sum exp * (z - max), target logit: one row block, one V range."""
        pid = tl.program_id(0)
        num_rb = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_N * S
        first_rb = (pid // per_group) * GROUP_N
        group_rows = tl.minimum(num_rb - first_rb, GROUP_N)
        rb = first_rb + (pid % per_group) % group_rows
        split = (pid % per_group) // group_rows

        offs_n = rb * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = offs_n < N
        tgt = tl.load(tgt_ptr + offs_n, mask=row_ok, other=-1)
        v_start = split * cols_per_split

        m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
        s = tl.zeros([BLOCK_N], dtype=tl.float32)
        a = tl.zeros([BLOCK_N], dtype=tl.float32)
        zt = tl.zeros([BLOCK_N], dtype=tl.float32)
        # Loop bounds are constexpr (H, CHUNKS) plus a guard, not range(v_start, min(...)): the
        # interpreter (triton 3.6, numpy 2.4) cannot use a runtime scalar as a range bound.
        for i in range(0, CHUNKS):
            v0 = v_start + i * BLOCK_V
            if v0 < V:
                offs_v = v0 + tl.arange(0, BLOCK_V)
                col_ok = offs_v < V
                z = _logits_tile(h_ptr, w_ptr, offs_n, offs_v, row_ok, col_ok, H, stride_hn,
                                 stride_hh, stride_wv, stride_wh, inv_temp, BLOCK_N, BLOCK_V,
                                 BLOCK_K, EVEN_K, INPUT_PRECISION, UPCAST)
                z = tl.where(col_ok[None, :], z, float("-inf"))
                m_new = tl.maximum(m, tl.max(z, axis=1))  # finite: a valid column in this chunk
                shift = tl.where(m == float("-inf"), 0.0, m - m_new)  # no 0 * -inf on chunk 1
                alpha = tl.exp(shift)
                zc = z - m_new[:, None]
                e = tl.exp(zc)  # 0 on padded columns
                a = alpha * (a + s * shift) + tl.sum(e * tl.where(col_ok[None, :], zc, 0.0), 1)
                s = alpha * s + tl.sum(e, axis=1)
                m = m_new
                zt += tl.sum(tl.where(offs_v[None, :] == tgt[:, None], z, 0.0), axis=1)

        out = part_ptr + split * N + offs_n
        tl.store(out, m, mask=row_ok)
        tl.store(out + S * N, s, mask=row_ok)
        tl.store(out + 2 * S * N, a, mask=row_ok)
        tl.store(out + 3 * S * N, zt, mask=row_ok)

    @triton.jit
    def _dlogits_kernel(h_ptr, w_ptr, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, dl_ptr,
                        N, V, H: tl.constexpr, inv_temp, stride_hn, stride_hh, stride_wv,
                        stride_wh, stride_dn,
                        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_N: tl.constexpr, EVEN_K: tl.constexpr,
                        INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """dlogits = (g_lp (onehot - p) - g_ent p (log p + H)) / T, one (BLOCK_N, BLOCK_V) tile."""
        pid = tl.program_id(0)
        num_rb = tl.cdiv(N, BLOCK_N)
        num_vb = tl.cdiv(V, BLOCK_V)
        per_group = GROUP_N * num_vb
        first_rb = (pid // per_group) * GROUP_N
        group_rows = tl.minimum(num_rb - first_rb, GROUP_N)
        rb = first_rb + (pid % per_group) % group_rows
        vb = (pid % per_group) // group_rows

        offs_n = rb * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        row_ok = offs_n < N
        col_ok = offs_v < V
        z = _logits_tile(h_ptr, w_ptr, offs_n, offs_v, row_ok, col_ok, H, stride_hn, stride_hh,
                         stride_wv, stride_wh, inv_temp, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K,
                         INPUT_PRECISION, UPCAST)
        tgt = tl.load(tgt_ptr + offs_n, mask=row_ok, other=-1)
        lse = tl.load(lse_ptr + offs_n, mask=row_ok, other=0.0)
        ent = tl.load(ent_ptr + offs_n, mask=row_ok, other=0.0)
        g_lp = tl.load(glp_ptr + offs_n, mask=row_ok, other=0.0)  # zero on ignored rows
        g_ent = tl.load(gent_ptr + offs_n, mask=row_ok, other=0.0)
        logp = z - lse[:, None]
        p = tl.exp(logp)
        onehot = tl.where(offs_v[None, :] == tgt[:, None], 1.0, 0.0)
        d = g_lp[:, None] * (onehot - p) - g_ent[:, None] * p * (logp + ent[:, None])
        d = d * inv_temp
        dl_ptrs = dl_ptr + offs_n[:, None].to(tl.int64) * stride_dn + offs_v[None, :]
        tl.store(dl_ptrs, d.to(dl_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _configs(kind: str, dtype: torch.dtype, device) -> dict:
    """Block sizes. Tiny in the interpreter (CPU tests: several chunks per row and per V range)."""
    if _interpreting() or device.type != "cuda":
        return dict(BLOCK_N=16, BLOCK_V=32, BLOCK_K=16, GROUP_N=2, num_warps=4, num_stages=1)
    if dtype == torch.float32:  # exact fp32 ("ieee") dots: correctness path, not tuned
        return dict(BLOCK_N=64, BLOCK_V=64, BLOCK_K=32, GROUP_N=8, num_warps=4, num_stages=3)
    if kind == "fwd":  # online-softmax epilogue holds a few (BLOCK_N, BLOCK_V) fp32 tiles
        return dict(BLOCK_N=128, BLOCK_V=128, BLOCK_K=64, GROUP_N=8, num_warps=8, num_stages=4)
    return dict(BLOCK_N=128, BLOCK_V=256, BLOCK_K=64, GROUP_N=8, num_warps=8, num_stages=3)


def _input_precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"  # ignored for bf16/fp16 inputs


# Candidates timed once per (kernel, dtype, H, V, N bucket) on large bf16/fp16 problems; the first
# is the default. BLOCK_N, BLOCK_V, BLOCK_K, num_warps, num_stages.
_CANDIDATES = {
    "fwd": [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4),
            (128, 128, 128, 8, 3), (64, 256, 64, 4, 4)],
    "bwd": [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (256, 128, 64, 8, 3),
            (128, 128, 128, 8, 3)],
}
_TUNE_MIN_WORK = 1 << 40  # N * H * V below which the default config is used untimed
TUNED = {}  # (kind, dtype, H, V, N bucket) -> chosen config; read by bench/bench_logprob.py


def _pick(kind, hidden, weight, launch):
    """Block config for this problem: the default, or the fastest candidate (timed once)."""
    cfg = _configs(kind, hidden.dtype, hidden.device)
    (N, H), V = hidden.shape, weight.shape[0]
    if (_interpreting() or hidden.device.type != "cuda" or hidden.dtype == torch.float32
            or N * H * V < _TUNE_MIN_WORK or os.environ.get("LOGPROB_TUNE", "1") == "0"):
        return cfg
    key = (kind, hidden.dtype, H, V, N.bit_length())
    if key not in TUNED:
        from triton.testing import do_bench

        best = (float("inf"), cfg)
        for bn, bv, bk, warps, stages in _CANDIDATES[kind]:
            c = dict(cfg, BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, num_warps=warps, num_stages=stages)
            try:
                ms = do_bench(lambda: launch(c), warmup=1, rep=5)
            except Exception:  # e.g. out of shared memory for this tile
                continue
            best = min(best, (ms, c), key=lambda x: x[0])
        TUNED[key] = best[1]
    return TUNED[key]


def _launch_fwd(hidden, weight, targets, temperature, cfg):
    N, H = hidden.shape
    V = weight.shape[0]
    BN, BV = cfg["BLOCK_N"], cfg["BLOCK_V"]
    # Split V into S ranges so that (row blocks x S) programs fill the GPU at any N. S comes from a
    # coarse rule (not from N exactly) because CHUNKS is a constexpr: few recompiles as N varies.
    row_blocks = triton.cdiv(N, BN)
    want = 8 if row_blocks * 8 >= 2 * _num_sms(hidden.device) else 32
    cols = max(triton.cdiv(triton.cdiv(V, want), BV) * BV, 4 * BV)  # a multiple of BLOCK_V
    S = triton.cdiv(V, cols)  # every range is non-empty
    part = torch.empty(4, S, N, device=hidden.device, dtype=torch.float32)  # (4, S, N)
    _fwd_kernel[(row_blocks * S,)](
        hidden, weight, targets, part, N, V, H, cols, cols // BV, S, 1.0 / temperature,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        BLOCK_N=BN, BLOCK_V=BV, BLOCK_K=cfg["BLOCK_K"], GROUP_N=cfg["GROUP_N"],
        EVEN_K=H % cfg["BLOCK_K"] == 0, INPUT_PRECISION=_input_precision(hidden.dtype),
        UPCAST=_interpreting(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return part


def _fused_forward(hidden, weight, targets, temperature):
    launch = lambda c: _launch_fwd(hidden, weight, targets, temperature, c)  # noqa: E731
    part = launch(_pick("fwd", hidden, weight, launch))  # (4, S, N)
    m, s, a, zt = part.unbind(0)  # each (S, N)
    m_max = m.max(0).values  # (N,)
    scale = torch.exp(m - m_max)  # (S, N)
    s_tot = (scale * s).sum(0)  # (N,)
    a_tot = (scale * (a + s * (m - m_max))).sum(0)  # (N,)
    log_s = torch.log(s_tot)
    lse = m_max + log_s  # (N,)
    entropy = log_s - a_tot / s_tot  # (N,)
    logp = zt.sum(0) - lse  # (N,)
    return logp, entropy, lse


_ADDMM_FP32 = {}  # device type -> whether addmm(out_dtype=float32, out=acc) works in place


def _addmm_fp32_(acc, a, b):
    """acc (fp32) += a @ b for bf16/fp16 a, b, in one cuBLAS call where torch supports it."""
    dev = acc.device.type
    if dev not in _ADDMM_FP32:
        try:
            x = torch.randn(8, 16, device=acc.device).to(a.dtype)
            y = torch.randn(16, 4, device=acc.device).to(a.dtype)
            c = torch.ones(8, 4, device=acc.device)
            torch.addmm(c, x, y, out_dtype=torch.float32, out=c)
            _ADDMM_FP32[dev] = torch.allclose(c, 1 + x.float() @ y.float(), rtol=1e-3, atol=1e-3)
        except (RuntimeError, TypeError, NotImplementedError):
            _ADDMM_FP32[dev] = False
    if _ADDMM_FP32[dev]:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += a @ b


def _fused_backward(hidden, weight, targets, lse, entropy, g_lp, g_ent, temperature,
                    need_dh, need_dw):
    N, H = hidden.shape
    V = weight.shape[0]
    cfg = _configs("bwd", hidden.dtype, hidden.device)
    rows = max(cfg["BLOCK_N"], (_BWD_CHUNK_BYTES // (V * hidden.element_size())) // 256 * 256)
    rows = min(rows, N)
    dh = torch.empty_like(hidden) if need_dh else None
    dw = None
    dw_acc = None
    if need_dw and rows < N:  # several chunks: accumulate dW in fp32 (or in the weight's dtype, see above)
        acc_dtype = torch.float32 if _DW_ACCUM_FP32 else weight.dtype
        dw_acc = torch.zeros(weight.shape, device=weight.device, dtype=acc_dtype)
    dl = torch.empty(rows, V, device=hidden.device, dtype=hidden.dtype)  # (rows, V) reused
    for r0 in range(0, N, rows):
        r1 = min(r0 + rows, N)
        h_c = hidden[r0:r1]
        dl_c = dl[: r1 - r0]

        def launch(c):
            grid = (triton.cdiv(r1 - r0, c["BLOCK_N"]) * triton.cdiv(V, c["BLOCK_V"]),)
            _dlogits_kernel[grid](
                h_c, weight, targets[r0:r1], lse[r0:r1], entropy[r0:r1], g_lp[r0:r1],
                g_ent[r0:r1], dl_c, r1 - r0, V, H, 1.0 / temperature,
                h_c.stride(0), h_c.stride(1), weight.stride(0), weight.stride(1), dl_c.stride(0),
                BLOCK_N=c["BLOCK_N"], BLOCK_V=c["BLOCK_V"], BLOCK_K=c["BLOCK_K"],
                GROUP_N=c["GROUP_N"], EVEN_K=H % c["BLOCK_K"] == 0,
                INPUT_PRECISION=_input_precision(hidden.dtype), UPCAST=_interpreting(),
                num_warps=c["num_warps"], num_stages=c["num_stages"],
            )

        if r0 == 0:
            cfg = _pick("bwd", h_c, weight, launch)
        launch(cfg)
        if need_dh:
            torch.mm(dl_c, weight, out=dh[r0:r1])
        if need_dw:
            if dw_acc is None:
                dw = dl_c.t() @ h_c
            elif hidden.dtype == torch.float32 or dw_acc.dtype == hidden.dtype:
                dw_acc.addmm_(dl_c.t(), h_c)
            else:
                _addmm_fp32_(dw_acc, dl_c.t(), h_c)
    if dw_acc is not None:
        dw = dw_acc.to(weight.dtype)
    return dh, dw


class _FusedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature):
        hidden = hidden.contiguous()
        weight = weight.contiguous()
        targets = targets.contiguous()
        logp, entropy, lse = _fused_forward(hidden, weight, targets, temperature)
        valid = targets != IGNORE_INDEX  # (N,)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy, valid)
        ctx.temperature = temperature
        zero = logp.new_zeros(())
        return torch.where(valid, logp, zero), torch.where(valid, entropy, zero)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, entropy, valid = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dh or need_dw) or hidden.shape[0] == 0:
            return None, None, None, None
        zero = lse.new_zeros(())
        g_lp = torch.zeros_like(lse) if g_lp is None else torch.where(valid, g_lp.float(), zero)
        g_ent = torch.zeros_like(lse) if g_ent is None else torch.where(valid, g_ent.float(), zero)
        dh, dw = _fused_backward(hidden, weight, targets, lse, entropy, g_lp.contiguous(),
                                 g_ent.contiguous(), ctx.temperature, need_dh, need_dw)
        return dh, dw, None, None


def token_logprobs(hidden, weight, targets, temperature: float = 1.0, impl: str = "auto"):
    """(logp (N,), entropy (N,)) in fp32 of targets under softmax(hidden @ weight.T / temperature).

    impl: "fused" (Triton), "torch" (fp32 reference, materialises the logits), "auto" (fused when
    on CUDA with Triton importable, torch otherwise).
    """
    assert hidden.dim() == 2 and weight.dim() == 2 and hidden.shape[1] == weight.shape[1]
    assert targets.shape == hidden.shape[:1], (targets.shape, hidden.shape)
    if impl == "auto":
        impl = "fused" if (hidden.is_cuda and HAS_TRITON) else "torch"
    if impl == "torch":
        return logprob_reference(hidden, weight, targets, temperature)
    if impl != "fused":
        raise ValueError(f"impl must be 'auto', 'fused' or 'torch', got {impl!r}")
    if not HAS_TRITON:
        raise RuntimeError("impl='fused' needs triton")
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32) + hidden.sum() * 0 + weight.sum() * 0
        return empty, empty.clone()
    return _FusedTokenLogprobs.apply(hidden, weight, targets, float(temperature))
