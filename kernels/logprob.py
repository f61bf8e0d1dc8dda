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

Implementation (impl="fused"): two variants of the logits, one backward loop
------------------------------------------------------------------------------
variant="triton". Forward: one kernel, a GEMM with an online-softmax
epilogue. Program = (block of BLOCK_N rows, range of V); it loops over BLOCK_V chunks of its range and
over H in BLOCK_K steps (tl.dot, fp32 accumulate), and writes (N,) partial stats per V range; a few
(S, N) torch ops merge them. Splitting V keeps the GPU full at small N, and programs are launched in
groups (GROUP_N row blocks x all V ranges) so that the h and W tiles in flight fit in L2, as a tiled
GEMM's grouped order does. Backward: a Triton GEMM kernel recomputes each logits tile and writes
dlogits in the input dtype straight from registers.

variant="cublas" (the default: faster on the H200, docs/kernels.md). cuBLAS computes each (rows, cols) block of
h @ W^T with fp32 output (torch.mm(out_dtype=float32): bf16 products, fp32 sums, no bf16 rounding of the logits)
and a memory-bound Triton kernel reads the block once: in the forward it folds it into running
(m, s, a, z_t) per row (the merge rule above), in the backward it writes dlogits. Costs one fp32
write + read of N x V (about 40 GB at the bench shape, some 10 ms at H200 bandwidth) and buys
cuBLAS's GEMM speed for the logits (about 690 TFLOP/s where our Triton GEMMs reach about 500).

Backward loop (both variants): row blocks outer, V chunks inner. For each row block r and chunk c:
dlogits[r, c] (either variant), dh_acc[r] += dlogits[r, c] @ W[c] (fp32 accumulator, cuBLAS with
out_dtype=float32: dh is rounded once), dW[c] += dlogits[r, c]^T @ h[r] (cuBLAS adds in fp32 and
stores the input dtype: dW is rounded once per row block). So the order bounds the roundings of dW
by the number of row blocks and keeps dh exact. Why not keep everything in registers: a program
owning dh rows must hold a (BLOCK_N, H) accumulator (917 KB at H = 3584) or recompute the logits
once per H slice; one kernel for dh and another for dW costs 5 GEMMs instead of 4; atomics cost
N H V / BLOCK_V read-modify-writes (about 1 TB at N = 32k, V = 152k). Any design that recomputes
the logits needs 4 GEMMs against the 3 of a plain matmul forward+backward, so fwd+bwd is at least
4/3 of the bare-matmul floor.

Memory. Workspace = what we allocate beyond the inputs, the saved (N,) stats and the returned dh, dW.
Budget workspace_mb (an argument of token_logprobs, default 320): the backward gives at most a third to
the fp32 dh accumulator (rows x H x 4 B; this sets rows, then rows are evened out so that the
blocks have equal size) and the rest to the (rows, cols) dlogits buffer (+ the fp32 logits block
for "cublas"); the cublas forward uses it for one fp32 logits block (all rows when they fit). At
N = 32768, H = 3584, V = 152064, bf16: rows 6656 (dW rounded 5 times), cols 17920 (triton) or
5888 (cublas), 334 / 331 MB = 1.7% of the fp32 logits (19.9 GB). A 2048 MB budget makes rows = N:
dW rounded once, as an unblocked backward would. fp32 inputs: dh is its own accumulator.

Fused loss (token_loss): the gradient inside the forward, 3 GEMMs
------------------------------------------------------------------
    loss, logp, entropy = token_loss(hidden, weight, targets, loss_fn, token_args, temperature)
token_logprobs cannot know g_lp, g_ent until backward, so it computes the logits twice (4 GEMMs). When
the loss is elementwise in (logp, H) given per-token constants known before the forward (GRPO's and
PPO's policy losses), token_loss takes it as loss_fn(logp, entropy, *token_args) -> (n,) and returns
loss = sum of it. For each block of `rows` rows: for each sub-block of `sub` rows, cuBLAS writes the
fp32 logits over ALL of V (sub, V), in one GEMM or in chunks of columns each folded into the stats right
after its GEMM (_loss_cfg's vchunk: the whole V by default); the stats kernel (V split into ranges) and a merge kernel give
logp, H, lse; loss_fn runs on the sub-block's (sub,) tensors under autograd, which gives g_lp =
d loss / d logp and g_ent = d loss / d H per row (elementwise, so the gradient of the sum is the
per-row derivative); the dlogits kernel (formula above) writes the sub-block's rows of a (rows, V)
dlogits buffer in the input dtype. Then dh[block] = dlogits @ W (one GEMM over all of V, rounded
once) and dW += dlogits^T @ h[block] (rounded once per block). backward multiplies the stored dh, dW
by the upstream scalar in place. Rows whose target is -100 get logp = H = 0 (loss_fn sees those) and
no gradient. Workspace: sub x V x 4 B (256 rows where they fit in half of workspace_mb; on CUDA at a small
hidden size more, up to sub x H = 256 x 3584, if they fit) + rows x V x elt (the rest): at the bench shape and 320 MB, sub = 256, rows = 512: 311 MB, dW rounded 64 times. Not for losses
that couple rows (DPO's sequence sums inside a sigmoid): their g_lp needs every row's logp first.
"""

import os
import warnings

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: impl="torch" still works
    HAS_TRITON = False

IGNORE_INDEX = -100


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _compiled(hidden) -> bool:
    """The kernels run compiled on a GPU (not on CPU, not in Triton's interpreter): the GPU's tiles apply."""
    return hidden.device.type == "cuda" and not _interpreting()


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
        rb, split = _grouped(tl.program_id(0), tl.cdiv(N, BLOCK_N), S, GROUP_N)

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
    def _grouped(pid, num_rb, num_cb, GROUP_N: tl.constexpr):
        """(row block, column block) of program `pid`, launched GROUP_N row blocks x all column blocks at a time,
        so the h and W tiles in flight fit in L2 (a tiled GEMM's grouped order)."""
        per_group = GROUP_N * num_cb
        first_rb = (pid // per_group) * GROUP_N
        group_rows = tl.minimum(num_rb - first_rb, GROUP_N)
        return first_rb + (pid % per_group) % group_rows, (pid % per_group) // group_rows

    @triton.jit
    def _dlogits_rows(z, offs_n, offs_v, row_ok, col0, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, inv_temp):
        """dlogits of a (rows, cols) tile of logits z, with the rows' target, statistics and upstream gradients."""
        tgt = tl.load(tgt_ptr + offs_n, mask=row_ok, other=-100)
        grad_ok = row_ok & (tgt != -100)  # rows whose target is IGNORE_INDEX get no gradient
        lse = tl.load(lse_ptr + offs_n, mask=row_ok, other=0.0)
        ent = tl.load(ent_ptr + offs_n, mask=row_ok, other=0.0)
        g_lp = tl.load(glp_ptr + offs_n, mask=grad_ok, other=0.0)
        g_ent = tl.load(gent_ptr + offs_n, mask=grad_ok, other=0.0)
        tgt -= col0
        return _dlogits_math(z, offs_v, tgt, lse, ent, g_lp, g_ent, inv_temp)

    @triton.jit
    def _dlogits_math(z, offs_v, tgt, lse, ent, g_lp, g_ent, inv_temp):
        """dlogits = (g_lp (onehot - p) - g_ent p (log p + H)) / T for a tile of z = logits / T."""
        logp = z - lse[:, None]
        p = tl.exp(logp)
        onehot = tl.where(offs_v[None, :] == tgt[:, None], 1.0, 0.0)
        d = g_lp[:, None] * (onehot - p) - g_ent[:, None] * p * (logp + ent[:, None])
        return d * inv_temp

    @triton.jit
    def _dlogits_kernel(h_ptr, w_ptr, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, dl_ptr,
                        N, V, H: tl.constexpr, col0, inv_temp, stride_hn, stride_hh, stride_wv,
                        stride_wh, stride_dn,
                        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_N: tl.constexpr, EVEN_K: tl.constexpr,
                        INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """One (BLOCK_N, BLOCK_V) tile of dlogits, the logits recomputed (w_ptr: rows col0.. of W)."""
        rb, vb = _grouped(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(V, BLOCK_V), GROUP_N)

        offs_n = rb * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        row_ok = offs_n < N
        col_ok = offs_v < V
        z = _logits_tile(h_ptr, w_ptr, offs_n, offs_v, row_ok, col_ok, H, stride_hn, stride_hh,
                         stride_wv, stride_wh, inv_temp, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K,
                         INPUT_PRECISION, UPCAST)
        d = _dlogits_rows(z, offs_n, offs_v, row_ok, col0, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, inv_temp)
        dl_ptrs = dl_ptr + offs_n[:, None].to(tl.int64) * stride_dn + offs_v[None, :]
        tl.store(dl_ptrs, d.to(dl_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    # ---- "cublas" variant: cuBLAS writes an fp32 block of h @ W^T, these kernels stream it once ----
    @triton.jit
    def _stats_update_kernel(z_ptr, tgt_ptr, stat_ptr, R, ncols, col0, stride_z, stride_s,
                             stride_p, inv_temp, CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_V: tl.constexpr, FRESH: tl.constexpr = False):
        """Fold an (R, ncols) fp32 block of h W^T (columns col0..) into running (m, s, a, z_t).
        Program (i, j) takes rows i * BLOCK_N.. and columns j * CHUNKS * BLOCK_V.. (a grid of one
        column range covers all columns), its stats at stat_ptr + j * stride_p. FRESH: start from
        no columns instead of loading the running stats."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        c_start = tl.program_id(1) * CHUNKS * BLOCK_V
        stat_ptr += tl.program_id(1) * stride_p
        row_ok = offs_n < R
        tgt = tl.load(tgt_ptr + offs_n, mask=row_ok, other=-1) - col0
        if FRESH:
            m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
            s = tl.zeros([BLOCK_N], dtype=tl.float32)
            a = tl.zeros([BLOCK_N], dtype=tl.float32)
            zt = tl.zeros([BLOCK_N], dtype=tl.float32)
        else:
            m = tl.load(stat_ptr + offs_n, mask=row_ok, other=0.0)
            s = tl.load(stat_ptr + stride_s + offs_n, mask=row_ok, other=0.0)
            a = tl.load(stat_ptr + 2 * stride_s + offs_n, mask=row_ok, other=0.0)
            zt = tl.load(stat_ptr + 3 * stride_s + offs_n, mask=row_ok, other=0.0)
        for i in range(0, CHUNKS):  # constexpr bound, see _fwd_kernel
            if c_start + i * BLOCK_V < ncols:
                offs_v = c_start + i * BLOCK_V + tl.arange(0, BLOCK_V)
                col_ok = offs_v < ncols
                z_ptrs = z_ptr + offs_n[:, None].to(tl.int64) * stride_z + offs_v[None, :]
                z = tl.load(z_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0) * inv_temp
                z = tl.where(col_ok[None, :], z, float("-inf"))
                m_new = tl.maximum(m, tl.max(z, axis=1))
                shift = tl.where(m == float("-inf"), 0.0, m - m_new)
                alpha = tl.exp(shift)
                zc = z - m_new[:, None]
                e = tl.exp(zc)
                a = alpha * (a + s * shift) + tl.sum(e * tl.where(col_ok[None, :], zc, 0.0), 1)
                s = alpha * s + tl.sum(e, axis=1)
                m = m_new
        # the target's logit: one load per row where it falls in this program's columns (not a compare and a fourth
        # row reduction per tile); ignored rows (-100) and targets in other columns add nothing
        mine = row_ok & (tgt >= c_start) & (tgt < c_start + CHUNKS * BLOCK_V) & (tgt < ncols)
        zt += tl.load(z_ptr + offs_n.to(tl.int64) * stride_z + tgt, mask=mine, other=0.0) * inv_temp
        tl.store(stat_ptr + offs_n, m, mask=row_ok)
        tl.store(stat_ptr + stride_s + offs_n, s, mask=row_ok)
        tl.store(stat_ptr + 2 * stride_s + offs_n, a, mask=row_ok)
        tl.store(stat_ptr + 3 * stride_s + offs_n, zt, mask=row_ok)

    @triton.jit
    def _dlogits_from_z_kernel(z_ptr, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, dl_ptr, R,
                               ncols, col0, stride_z, stride_d, inv_temp,
                               BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
        """One (BLOCK_N, BLOCK_V) tile of dlogits from an fp32 block of h W^T (columns col0..)."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        row_ok = offs_n < R
        ok = row_ok[:, None] & (offs_v < ncols)[None, :]
        rows64 = offs_n[:, None].to(tl.int64)
        z = tl.load(z_ptr + rows64 * stride_z + offs_v[None, :], mask=ok, other=0.0) * inv_temp
        d = _dlogits_rows(z, offs_n, offs_v, row_ok, col0, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, inv_temp)
        tl.store(dl_ptr + rows64 * stride_d + offs_v[None, :], d.to(dl_ptr.dtype.element_ty),
                 mask=ok)

    @triton.jit
    def _finish_stats_kernel(part_ptr, tgt_ptr, logp_ptr, ent_ptr, lse_ptr, R, S, stride_k, stride_s,
                             BLOCK_N: tl.constexpr, S_P2: tl.constexpr):
        """logp, entropy (0 where the target is -100) and lse of R rows from the (4, S, R) partial
        (m, s, a, z_t) of S disjoint V ranges (the merge of _fused_forward, per row)."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_s = tl.arange(0, S_P2)
        row_ok = offs_n < R
        ok = (offs_s < S)[:, None] & row_ok[None, :]
        ptrs = part_ptr + offs_s[:, None] * stride_s + offs_n[None, :]  # (S_P2, BLOCK_N)
        m = tl.load(ptrs, mask=ok, other=float("-inf"))
        s = tl.load(ptrs + stride_k, mask=ok, other=0.0)
        a = tl.load(ptrs + 2 * stride_k, mask=ok, other=0.0)
        zt = tl.load(ptrs + 3 * stride_k, mask=ok, other=0.0)
        m_max = tl.max(m, axis=0)  # (BLOCK_N,); finite on valid rows: every range is non-empty
        m_max = tl.where(row_ok, m_max, 0.0)
        shift = tl.where(ok, m - m_max[None, :], 0.0)
        scale = tl.where(ok, tl.exp(shift), 0.0)
        s_tot = tl.sum(scale * s, axis=0)
        a_tot = tl.sum(scale * (a + s * shift), axis=0)
        s_tot = tl.where(row_ok, s_tot, 1.0)
        log_s = tl.log(s_tot)
        lse = m_max + log_s
        tgt = tl.load(tgt_ptr + offs_n, mask=row_ok, other=-100)
        valid = tgt != -100
        tl.store(logp_ptr + offs_n, tl.where(valid, tl.sum(zt, axis=0) - lse, 0.0), mask=row_ok)
        tl.store(ent_ptr + offs_n, tl.where(valid, log_s - a_tot / s_tot, 0.0), mask=row_ok)
        tl.store(lse_ptr + offs_n, lse, mask=row_ok)

    @triton.jit
    def _scale_kernel(x_ptr, g_ptr, n, BLOCK: tl.constexpr):
        """x *= g in place, g a scalar read from memory (the upstream gradient): one vectorised pass."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(x_ptr + offs, mask=ok)
        y = x.to(tl.float32) * tl.load(g_ptr)
        tl.store(x_ptr + offs, y.to(x_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=ok)


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
            (128, 128, 128, 8, 3), (64, 256, 64, 4, 4), (128, 256, 64, 8, 4)],
    "bwd": [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (256, 128, 64, 8, 3),
            (128, 128, 128, 8, 3), (128, 256, 64, 8, 4)],
}
_TUNE_MIN_WORK = 1 << 40  # N * H * V below which the default config is used untimed
TUNED = {}  # a cache, not a setting: (kind, dtype, H, V, N bucket) -> chosen config (bench_logprob.py prints it)


def _pick(kind, hidden, weight, launch, tune):
    """Block config for this problem: the default, or (tune) the fastest candidate, timed once."""
    cfg = _configs(kind, hidden.dtype, hidden.device)
    (N, H), V = hidden.shape, weight.shape[0]
    if (not _compiled(hidden) or hidden.dtype == torch.float32
            or N * H * V < _TUNE_MIN_WORK or not tune):
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


def _fused_forward(hidden, weight, targets, temperature, workspace_bytes, tune):
    launch = lambda c: _launch_fwd(hidden, weight, targets, temperature, c)  # noqa: E731
    part = launch(_pick("fwd", hidden, weight, launch, tune))  # (4, S, N); needs no workspace
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


_MM_FP32 = {}  # (device type, dtype) -> (mm, addmm) with out_dtype=float32 and out= work


def _probe_mm_fp32(device, dtype):
    x = torch.randn(8, 16, device=device).to(dtype)
    y = torch.randn(4, 16, device=device).to(dtype).t()  # transposed, as W_c^T
    want = x.float() @ y.float()
    ok = []
    for accumulate in (False, True):
        c = torch.ones(8, 4, device=device)
        try:
            if accumulate:
                torch.addmm(c, x, y, out_dtype=torch.float32, out=c)
            else:
                torch.mm(x, y, out_dtype=torch.float32, out=c)
            ok.append(torch.allclose(c, want + float(accumulate), rtol=1e-4, atol=1e-4))
        except (RuntimeError, TypeError, NotImplementedError):
            ok.append(False)
    if device.type == "cuda" and not ok[0]:
        warnings.warn("torch.mm(out_dtype=float32) unavailable: kernels.logprob multiplies fp32 "
                      "copies (slow); torch >= 2.8 has it")
    return tuple(ok)


def _mm_fp32(a, b, out, accumulate=False):
    """out (fp32) = a @ b, or out += a @ b: products of bf16/fp16 a, b summed in fp32, never rounded
    to the input dtype. One cuBLAS call where torch has mm/addmm(out_dtype=float32) (CUDA, torch >=
    2.8); elsewhere (CPU) on fp32 copies of a and b."""
    if a.dtype == torch.float32:
        return torch.addmm(out, a, b, out=out) if accumulate else torch.mm(a, b, out=out)
    key = (out.device.type, a.dtype)
    if key not in _MM_FP32:
        _MM_FP32[key] = _probe_mm_fp32(out.device, a.dtype)
    mm_ok, addmm_ok = _MM_FP32[key]
    if accumulate and addmm_ok:
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    elif accumulate and mm_ok:  # a temporary the size of out
        out += torch.mm(a, b, out_dtype=torch.float32)
    elif mm_ok:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    elif accumulate:
        out.addmm_(a.float(), b.float())
    else:
        torch.mm(a.float(), b.float(), out=out)


def _align(hidden) -> int:
    return 128 if _compiled(hidden) else 16


def _split(n: int, most: int, align: int) -> int:
    """Block length <= most that cuts n into nearly equal blocks, a multiple of align (or n)."""
    if n <= most:
        return n
    per_block = triton.cdiv(n, triton.cdiv(n, most))
    return min(most, triton.cdiv(per_block, align) * align)


def _bwd_tiles(N, V, H, elt_bytes, budget, align):
    """(rows, cols) of the backward's blocks. rows: the fp32 dh accumulator (rows, H) takes at most a
    third of the budget; cols: the (rows, cols) logits + dlogits buffers (elt_bytes each) the rest."""
    rows = _split(N, max(align, budget // 3 // (4 * H) // align * align), align)
    cols = max(align, (budget - rows * 4 * H) // (rows * elt_bytes) // align * align)
    return rows, min(V, cols)


def _fwd_tiles(N, V, budget, align):
    """(rows, cols) of the fp32 logits block of the cublas forward: all rows when 8 aligned column
    blocks fit, so each GEMM is tall."""
    cols = min(V, max(8 * align, budget // (4 * N) // align * align))
    return _split(N, max(align, budget // (4 * cols) // align * align), align), cols


def _stream_cfg(hidden):
    """Tile of the memory-bound kernels: small in the interpreter (several column blocks per chunk)."""
    if not _compiled(hidden):
        return dict(BLOCK_N=16, BLOCK_V=32, num_warps=4)
    return dict(BLOCK_N=16, BLOCK_V=512, num_warps=8)


def _cublas_forward(hidden, weight, targets, temperature, workspace_bytes, tune):
    """Online logsumexp / entropy / target logit over fp32 blocks of h @ W^T written by cuBLAS."""
    N, V = hidden.shape[0], weight.shape[0]
    rows, cols = _fwd_tiles(N, V, workspace_bytes, _align(hidden))
    stats = torch.zeros(4, N, device=hidden.device, dtype=torch.float32)  # (4, N): m, s, a, z_t
    stats[0] = float("-inf")
    z_buf = torch.empty(rows * cols, device=hidden.device, dtype=torch.float32)
    c = _stream_cfg(hidden)
    for r0 in range(0, N, rows):
        r1 = min(r0 + rows, N)
        st = stats[:, r0:r1]
        for v0 in range(0, V, cols):
            v1 = min(v0 + cols, V)
            z = z_buf[: (r1 - r0) * (v1 - v0)].view(r1 - r0, v1 - v0)  # (rows, cols)
            _mm_fp32(hidden[r0:r1], weight[v0:v1].t(), z)
            _stats_update_kernel[(triton.cdiv(r1 - r0, c["BLOCK_N"]),)](
                z, targets[r0:r1], st, r1 - r0, v1 - v0, v0, z.stride(0), st.stride(0), 0,
                1.0 / temperature, CHUNKS=triton.cdiv(cols, c["BLOCK_V"]), BLOCK_N=c["BLOCK_N"],
                BLOCK_V=c["BLOCK_V"], num_warps=c["num_warps"])
    m, s, a, zt = stats.unbind(0)  # each (N,)
    log_s = torch.log(s)
    lse = m + log_s  # (N,)
    return zt - lse, log_s - a / s, lse


def _backward(hidden, weight, targets, lse, entropy, g_lp, g_ent, temperature, need_dh, need_dw,
              variant, workspace_bytes, tune):
    """dh, dW in blocks of rows (outer) x columns of V (inner); see "Memory" in the docstring."""
    N, H = hidden.shape
    V = weight.shape[0]
    fp32 = hidden.dtype == torch.float32
    elt = hidden.element_size() + (4 if variant == "cublas" else 0)  # dlogits (+ fp32 logits)
    rows, cols = _bwd_tiles(N, V, H, elt, workspace_bytes, _align(hidden))
    dh = torch.empty_like(hidden) if need_dh else None  # (N, H)
    dw = torch.empty_like(weight) if need_dw else None  # (V, H)
    dh_acc = None
    if need_dh and not fp32:  # fp32 inputs accumulate straight into dh
        dh_acc = torch.empty(rows, H, device=hidden.device, dtype=torch.float32)  # (rows, H)
    dl_buf = torch.empty(rows * cols, device=hidden.device, dtype=hidden.dtype)
    z_buf = None
    if variant == "cublas":
        z_buf = torch.empty(rows * cols, device=hidden.device, dtype=torch.float32)
    inv_temp = 1.0 / temperature
    cfg = _configs("bwd", hidden.dtype, hidden.device)
    sc = _stream_cfg(hidden)
    for r0 in range(0, N, rows):
        r1 = min(r0 + rows, N)
        h_r = hidden[r0:r1]
        row_args = (targets[r0:r1], lse[r0:r1], entropy[r0:r1], g_lp[r0:r1], g_ent[r0:r1])
        acc = dh[r0:r1] if fp32 and need_dh else (dh_acc[: r1 - r0] if need_dh else None)
        for v0 in range(0, V, cols):
            v1 = min(v0 + cols, V)
            w_c = weight[v0:v1]
            dl = dl_buf[: (r1 - r0) * (v1 - v0)].view(r1 - r0, v1 - v0)  # (rows, cols)
            if variant == "cublas":
                z = z_buf[: dl.numel()].view_as(dl)  # (rows, cols) fp32
                _mm_fp32(h_r, w_c.t(), z)
                grid = (triton.cdiv(r1 - r0, sc["BLOCK_N"]), triton.cdiv(v1 - v0, sc["BLOCK_V"]))
                _dlogits_from_z_kernel[grid](
                    z, *row_args, dl, r1 - r0, v1 - v0, v0, z.stride(0), dl.stride(0), inv_temp,
                    BLOCK_N=sc["BLOCK_N"], BLOCK_V=sc["BLOCK_V"], num_warps=sc["num_warps"])
            else:
                def launch(c, h_r=h_r, w_c=w_c, dl=dl, v0=v0, row_args=row_args):
                    n, v = dl.shape
                    grid = (triton.cdiv(n, c["BLOCK_N"]) * triton.cdiv(v, c["BLOCK_V"]),)
                    _dlogits_kernel[grid](
                        h_r, w_c, *row_args, dl, n, v, H, v0, inv_temp, h_r.stride(0),
                        h_r.stride(1), w_c.stride(0), w_c.stride(1), dl.stride(0),
                        BLOCK_N=c["BLOCK_N"], BLOCK_V=c["BLOCK_V"], BLOCK_K=c["BLOCK_K"],
                        GROUP_N=c["GROUP_N"], EVEN_K=H % c["BLOCK_K"] == 0,
                        INPUT_PRECISION=_input_precision(hidden.dtype), UPCAST=_interpreting(),
                        num_warps=c["num_warps"], num_stages=c["num_stages"])

                if r0 == 0 and v0 == 0:
                    cfg = _pick("bwd", h_r, w_c, launch, tune)
                launch(cfg)
            if need_dh:  # fp32 sum over all of V, one rounding at the end of the row block
                _mm_fp32(dl, w_c, acc, accumulate=v0 > 0)
            if need_dw:  # one rounding per row block (cuBLAS adds in fp32, stores the input dtype)
                if r0 == 0:
                    torch.mm(dl.t(), h_r, out=dw[v0:v1])
                else:
                    dw[v0:v1].addmm_(dl.t(), h_r)
        if need_dh and not fp32:
            dh[r0:r1].copy_(acc)
    return dh, dw


class _FusedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, variant, workspace_bytes, tune):
        hidden = hidden.contiguous()
        weight = weight.contiguous()
        targets = targets.contiguous()
        forward = _cublas_forward if variant == "cublas" else _fused_forward
        logp, entropy, lse = forward(hidden, weight, targets, temperature, workspace_bytes, tune)
        valid = targets != IGNORE_INDEX  # (N,)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy, valid)
        ctx.temperature = temperature
        ctx.variant, ctx.workspace_bytes, ctx.tune = variant, workspace_bytes, tune
        zero = logp.new_zeros(())
        return torch.where(valid, logp, zero), torch.where(valid, entropy, zero)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, entropy, valid = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dh or need_dw) or hidden.shape[0] == 0:
            return None, None, None, None, None, None, None
        zero = lse.new_zeros(())
        g_lp = torch.zeros_like(lse) if g_lp is None else torch.where(valid, g_lp.float(), zero)
        g_ent = torch.zeros_like(lse) if g_ent is None else torch.where(valid, g_ent.float(), zero)
        dh, dw = _backward(hidden, weight, targets, lse, entropy, g_lp.contiguous(),
                           g_ent.contiguous(), ctx.temperature, need_dh, need_dw, ctx.variant,
                           ctx.workspace_bytes, ctx.tune)
        return dh, dw, None, None, None, None, None


def token_logprobs(hidden, weight, targets, temperature: float = 1.0, impl: str = "auto",
                   variant: str = "cublas", workspace_mb: int = 320, tune: bool = True):
    """(logp (N,), entropy (N,)) in fp32 of targets under softmax(hidden @ weight.T / temperature).

    impl: "fused" (Triton), "torch" (fp32 reference, materialises the logits), "auto" (fused when on
    CUDA with Triton importable, torch otherwise). The settings below apply to impl="fused" only:
    variant: how the logits are computed (module docstring): "cublas" GEMMs into fp32 blocks +
      memory-bound Triton kernels (the default, faster on the H200), or "triton" GEMM kernels with
      fused epilogues.
    workspace_mb: memory beyond the inputs, the saved (N,) stats and the returned dh, dW ("Memory" in
      the module docstring): 320 MB is under 2% of the fp32 logits at N = 32k, V = 152k; a larger
      budget rounds dW fewer times.
    tune: time the block-config candidates once per large bf16/fp16 problem shape (False: defaults).
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
    if variant not in ("triton", "cublas"):
        raise ValueError(f"variant must be 'triton' or 'cublas', got {variant!r}")
    if workspace_mb <= 0:
        raise ValueError(f"workspace_mb must be positive, got {workspace_mb}")
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32) + hidden.sum() * 0 + weight.sum() * 0
        return empty, empty.clone()
    return _FusedTokenLogprobs.apply(hidden, weight, targets, float(temperature), variant,
                                     int(workspace_mb) << 20, bool(tune))


# ---------------------------------------------------------------------------------------------
# Fused loss: the gradient computed inside the forward (3 GEMMs instead of 4)
# ---------------------------------------------------------------------------------------------
_SUB_WORK = 256 * 3584  # rows x hidden size of one sub-block at the bench shape (7B head), where the GPU's work per
# sub-block outlasts the host's (loss_fn, its autograd, the launches); at a 0.5B head (H 896) 256 rows did not (docs)


def _loss_tiles(N, V, elt_bytes, budget, align, sub=None, hidden_size=None):
    """(rows, sub) of token_loss: dlogits blocks of `rows` rows x all of V (elt_bytes each) and,
    inside each, fp32 logits sub-blocks of `sub` rows x all of V. sub (default): 2 x align (256 on
    CUDA), or align where that would take over half the budget: each sub-block's logits GEMM reads
    all of W for `sub` FLOP per byte, and below about 140 (the H200's measured 690 TFLOP/s over its
    4.8 TB/s) it waits on memory. With hidden_size (on CUDA), more rows where H is small, so that
    sub x H >= _SUB_WORK (1024 rows at H = 896), if their logits fit in half the budget: the host issues
    the same work per sub-block at any H. rows: the rest of the budget, a multiple of sub (or N), evened out."""
    if sub is None and hidden_size:
        sub = max(2 * align, triton.cdiv(triton.cdiv(_SUB_WORK, hidden_size), align) * align)
        sub = sub if sub * 4 * V <= budget // 2 else None
    if sub is None:
        sub = 2 * align if 2 * align * 4 * V <= budget // 2 else align
    sub = min(N, sub)
    rows = max(sub, (budget - sub * 4 * V) // (elt_bytes * V) // sub * sub)
    return _split(N, rows, sub), sub


def _loss_cfg(hidden):
    """token_loss's inner loop: its stats and dlogits kernels' tiles, the stats kernel's programs per SM (V split
    into ranges until there are that many) and vchunk, the columns of each logits GEMM, whose stats are folded in
    right after it (None: all of V, one GEMM per sub-block; narrower chunks are read back while they may still be
    in the L2 cache). bench_logprob.py --loss-stream / --loss-vchunk time others. On CUDA: the fastest tiles of a
    sweep on one H200, 2026-12-02 (N 32768, H 3584, 2,048 MB: 4 x 2048, 8 warps, 4 programs per SM, fwd+bwd 183.5
    ms against 186.8-188.7 for the other five; docs/kernels.md)."""
    if not _compiled(hidden):
        return dict(_stream_cfg(hidden), per_sm=2, vchunk=None)
    return dict(BLOCK_N=4, BLOCK_V=2048, num_warps=8, per_sm=4, vchunk=None)


def _per_token(token_args, n, device):
    """token_args with the (n,) tensors checked: the rest (numbers, 0-dim tensors) pass as they are."""
    for i, x in enumerate(token_args):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            if x.device != device:
                raise ValueError(f"token_loss: token_args[{i}] is on {x.device}, hidden on {device}: "
                                 f"move it with .to(hidden.device)")
            if x.shape != (n,):
                raise ValueError(f"token_loss: token_args[{i}] has shape {tuple(x.shape)}; per-token "
                                 f"arguments must be ({n},), one value per row of hidden (flatten them "
                                 f"the way hidden is), or a number / 0-dim tensor")
            if x.requires_grad:
                raise ValueError(f"token_loss: token_args[{i}] requires grad, but only hidden and "
                                 f"weight get gradients: pass it .detach()ed")


def _take(token_args, r0, r1):
    return [x[r0:r1] if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in token_args]


def _check_loss(loss, logp):
    if not isinstance(loss, torch.Tensor) or loss.shape != logp.shape:
        got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"token_loss: loss_fn must return the per-token loss, a tensor of shape "
                         f"{tuple(logp.shape)} like its logp argument; it returned {got}")


def _row_loss(loss_fn, logp, entropy, args, need_grad):
    """Per-row loss (n,) fp32 and, with need_grad, its derivatives in logp and entropy (n,)."""
    lp = logp.detach().requires_grad_(need_grad)
    ent = entropy.detach().requires_grad_(need_grad)
    g_lp = g_ent = None
    with torch.enable_grad():  # the autograd Function's forward runs without it
        loss = loss_fn(lp, ent, *args)
        _check_loss(loss, lp)
        if need_grad and loss.requires_grad:
            g_lp, g_ent = torch.autograd.grad(loss.sum(), (lp, ent), allow_unused=True)
    g_lp = torch.zeros_like(lp) if g_lp is None else g_lp.float()
    g_ent = torch.zeros_like(lp) if g_ent is None else g_ent.float()
    return loss.detach().float(), g_lp.detach().contiguous(), g_ent.detach().contiguous()


def _loss_forward(hidden, weight, targets, loss_fn, token_args, temperature, need_dh, need_dw,
                  workspace_bytes):
    """Loss, logp, entropy and (needed) dh, dW: for each block of rows, the fp32 logits over all of V
    in sub-blocks, their stats, loss_fn and its derivatives, dlogits; then dh, dW of the block."""
    N, H = hidden.shape
    V = weight.shape[0]
    need_grad = need_dh or need_dw
    rows, sub = _loss_tiles(N, V, hidden.element_size(), workspace_bytes, _align(hidden),
                            hidden_size=H if _compiled(hidden) else None)
    dh = torch.empty_like(hidden) if need_dh else None  # (N, H)
    dw = torch.empty_like(weight) if need_dw else None  # (V, H)
    logp = torch.empty(N, device=hidden.device, dtype=torch.float32)  # (N,)
    entropy = torch.empty_like(logp)  # (N,)
    loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
    z_buf = torch.empty(sub, V, device=hidden.device, dtype=torch.float32)  # (sub, V)
    dl_buf = torch.empty(rows, V, device=hidden.device, dtype=hidden.dtype) if need_grad else None
    c = _loss_cfg(hidden)
    vc = min(V, c["vchunk"] or V)  # columns per logits GEMM
    # The stats kernel splits each chunk of vc columns into S ranges so that (row tiles x S) programs fill
    # the GPU; range j of every chunk folds into partial j, and the first chunk (vc wide) fills every range.
    row_tiles = triton.cdiv(sub, c["BLOCK_N"])
    want = triton.cdiv(c["per_sm"] * _num_sms(hidden.device), row_tiles)
    cols = triton.cdiv(triton.cdiv(vc, want), c["BLOCK_V"]) * c["BLOCK_V"]
    S = triton.cdiv(vc, cols)
    part = torch.empty(4, S, sub, device=hidden.device, dtype=torch.float32)  # (4, S, sub)
    lse_buf = torch.empty(sub, device=hidden.device, dtype=torch.float32)  # (sub,)
    inv_temp = 1.0 / temperature
    for r0 in range(0, N, rows):
        r1 = min(r0 + rows, N)
        for s0 in range(r0, r1, sub):
            s1 = min(s0 + sub, r1)
            n = s1 - s0
            # Few host calls per sub-block (the GPU's work per sub-block is short): two Triton
            # kernels make the stats, loss_fn and autograd the per-row derivatives, one kernel dlogits.
            z, tgt, lse, lp_s, ent_s = z_buf[:n], targets[s0:s1], lse_buf[:n], logp[s0:s1], entropy[s0:s1]
            for v0 in range(0, V, vc):  # (n, V) fp32 logits, vc columns at a time
                zc = z[:, v0:v0 + vc]  # (n, <= vc), rows V apart
                _mm_fp32(hidden[s0:s1], weight[v0:v0 + vc].t(), zc)
                _stats_update_kernel[(triton.cdiv(n, c["BLOCK_N"]), S)](
                    zc, tgt, part, n, zc.shape[1], v0, z.stride(0), part.stride(0), part.stride(1),
                    inv_temp, CHUNKS=cols // c["BLOCK_V"], BLOCK_N=c["BLOCK_N"], BLOCK_V=c["BLOCK_V"],
                    FRESH=v0 == 0, num_warps=c["num_warps"])
            _finish_stats_kernel[(triton.cdiv(n, 32),)](
                part, tgt, lp_s, ent_s, lse, n, S, part.stride(0), part.stride(1), BLOCK_N=32,
                S_P2=triton.next_power_of_2(S))
            loss_s, g_lp, g_ent = _row_loss(loss_fn, lp_s, ent_s, _take(token_args, s0, s1), need_grad)
            loss += loss_s.sum()
            if need_grad:  # the kernel zeroes ignored rows' gradient, whatever loss_fn says
                dl = dl_buf[s0 - r0:s1 - r0]  # (n, V)
                grid = (triton.cdiv(n, c["BLOCK_N"]), triton.cdiv(V, c["BLOCK_V"]))
                _dlogits_from_z_kernel[grid](
                    z, tgt, lse, ent_s, g_lp, g_ent, dl, n, V, 0, z.stride(0), dl.stride(0),
                    inv_temp, BLOCK_N=c["BLOCK_N"], BLOCK_V=c["BLOCK_V"], num_warps=c["num_warps"])
        dl = dl_buf[: r1 - r0] if need_grad else None  # (rows, V)
        if need_dh:  # one GEMM over all of V: fp32 sums, dh rounded once
            torch.mm(dl, weight, out=dh[r0:r1])
        if need_dw:  # one rounding per block of rows (cuBLAS adds in fp32, stores the input dtype)
            if r0 == 0:
                torch.mm(dl.t(), hidden[r0:r1], out=dw)
            else:
                dw.addmm_(dl.t(), hidden[r0:r1])
    return loss, logp, entropy, dh, dw


def _scale_(x, g):
    """x *= g (a 0-dim tensor) in place. On the GPU a Triton pass: torch's mul_ of a bf16 tensor by an fp32 0-dim
    one takes its slow (unvectorised) path, 3.1 ms for dh and dW at the bench's shape (profiled on one H200,
    2026-12-02)."""
    if HAS_TRITON and x.numel() and x.is_contiguous() and g.numel() == 1 and (x.is_cuda or _interpreting()):
        n = x.numel()
        block = 8192 if _compiled(x) else 64
        _scale_kernel[(triton.cdiv(n, block),)](x, g.reshape(()).float(), n, BLOCK=block, num_warps=8)
    else:
        x.mul_(g)


class _FusedTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, loss_fn, token_args, temperature, need_dh, need_dw,
                workspace_bytes):
        loss, logp, entropy, dh, dw = _loss_forward(
            hidden.contiguous(), weight.contiguous(), targets.contiguous(), loss_fn, token_args,
            temperature, need_dh, need_dw, workspace_bytes)
        ctx.grads = (dh, dw)
        ctx.mark_non_differentiable(logp, entropy)
        return loss, logp, entropy

    @staticmethod
    def backward(ctx, g, _g_lp, _g_ent):
        if ctx.grads is None:
            raise RuntimeError("token_loss: its gradients were handed over by the first backward; a "
                               "second backward through the same call (retain_graph=True) is not "
                               "supported: call token_loss again")
        dh, dw = ctx.grads
        ctx.grads = None  # the stored gradients become the returned ones: no copy
        for x in (dh, dw):
            if x is not None:
                _scale_(x, g)
        return dh, dw, None, None, None, None, None, None, None


def token_loss(hidden, weight, targets, loss_fn, token_args=(), temperature: float = 1.0,
               impl: str = "auto", workspace_mb: int = 320):
    """(loss, logp, entropy): loss = sum over rows of loss_fn(logp, entropy, *token_args), a scalar
    differentiable in hidden and weight, with logp, entropy (N,) fp32 as token_logprobs returns them
    (0 on rows whose target is -100), detached, for statistics.

    loss_fn(logp, entropy, *args) -> (n,) per-token loss, called on blocks of n rows: it must be
    elementwise (row i's loss depends only on row i of logp, entropy and args) and differentiable by
    autograd, which gives d loss / d logp and d loss / d entropy per row. token_args: its per-token
    constants, (N,) tensors cut to the block's rows (advantages, old and reference log-probs, mask,
    weights such as mask / normaliser), or numbers and 0-dim tensors passed whole. Only hidden and
    weight get gradients. The gradient is computed during the forward (module docstring, "Fused
    loss"); backward multiplies it by the upstream scalar, once.
    impl: "fused" (Triton + cuBLAS), "torch" (loss_fn on logprob_reference: materialises the
    logits), "auto" (fused on CUDA with Triton, torch otherwise). workspace_mb: memory beyond the
    inputs and the gradients dh, dW.
    """
    assert hidden.dim() == 2 and weight.dim() == 2 and hidden.shape[1] == weight.shape[1]
    assert targets.shape == hidden.shape[:1], (targets.shape, hidden.shape)
    if not callable(loss_fn):
        raise TypeError(f"token_loss: loss_fn must be callable as loss_fn(logp, entropy, *token_args), "
                        f"got {type(loss_fn).__name__}")
    token_args = tuple(token_args)
    _per_token(token_args, hidden.shape[0], hidden.device)
    if impl == "auto":
        impl = "fused" if (hidden.is_cuda and HAS_TRITON) else "torch"
    if impl == "torch":
        logp, entropy = logprob_reference(hidden, weight, targets, temperature)
        loss = loss_fn(logp, entropy, *token_args)
        _check_loss(loss, logp)
        return loss.float().sum(), logp.detach(), entropy.detach()
    if impl != "fused":
        raise ValueError(f"impl must be 'auto', 'fused' or 'torch', got {impl!r}")
    if not HAS_TRITON:
        raise RuntimeError("impl='fused' needs triton")
    if workspace_mb <= 0:
        raise ValueError(f"workspace_mb must be positive, got {workspace_mb}")
    grad = torch.is_grad_enabled()
    need_dh, need_dw = grad and hidden.requires_grad, grad and weight.requires_grad
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return hidden.sum().float() * 0 + weight.sum().float() * 0, empty, empty.clone()
    return _FusedTokenLoss.apply(hidden, weight, targets, loss_fn, token_args, float(temperature),
                                 need_dh, need_dw, int(workspace_mb) << 20)
