"""Variable-length (packed) attention for the trainer: `--attn-impl varlen`.

A packed row holds several sequences back to back (common/packing.py). With sdpa, transformers builds a (T, T)
block-diagonal causal mask from the position ids and sdpa then runs its slow masked path over the whole row;
a varlen kernel instead takes the sequence boundaries (cu_seqlens) and never touches the cross-sequence blocks.

`register_varlen_attention()` adds "varlen" to transformers' AttentionInterface. The function picks, in order:
  1. flash-attn's `flash_attn_varlen_func` (if installed; CUDA, bf16/fp16),
  2. torch's `torch.nn.attention.varlen.varlen_attn` (torch >= 2.9; CUDA, bf16/fp16),
  3. a pure-torch reference: a loop of causal sdpa calls, one per sequence (CPU, fp32; tests).
No mask function is registered: for an implementation absent from transformers' AttentionMaskInterface,
create_causal_mask returns None at once (masking_utils._preprocess_mask_arguments), so no (T, T) mask is built.

Boundaries come from the FlashAttentionKwargs transformers forwards to every attention call (`attn_kwargs(mb)`
builds them from a MicroBatch), or, when absent, from where the position ids restart (one device sync).
"""
import importlib.util
import inspect

import torch
import torch.nn.functional as F

NAME = "varlen"


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(B, T) position ids restarting at each sequence -> (n+1,) int32 boundaries of the flattened (B*T) tokens
    and the longest sequence. A new sequence starts where the position does not follow the previous one by 1,
    and at the start of every row."""
    B, T = position_ids.shape
    start = torch.ones_like(position_ids, dtype=torch.bool)  # (B, T)
    start[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    starts = start.flatten().nonzero().flatten()
    total = torch.tensor([B * T], device=position_ids.device)
    cu = torch.cat([starts, total]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def reference_varlen_attention(q, k, v, cu_seqlens, scale: float | None = None, cu_seqlens_k=None,
                               window: int | None = None) -> torch.Tensor:
    """Causal attention within each sequence of a packed batch, one sdpa call per sequence.
    q: (N, Hq, D), k, v: (N_k, Hkv, D) with Hq a multiple of Hkv (GQA); cu_seqlens: (n+1,) of q, cu_seqlens_k of k
    (None: the same). A segment with more keys than queries aligns them at the end (flash-attn's causal): query i of
    t attends to keys 0 .. s - t + i of s; with a sliding window W, only the last W of those (itself included,
    transformers' sliding_window). Returns (N, Hq, D)."""
    groups = q.shape[1] // k.shape[1]
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    out = []
    for a, b, c, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        qi, ki, vi = (x.transpose(0, 1)[None] for x in (q[a:b], k[c:e], v[c:e]))  # (1, H, t, D), (1, H, s, D)
        if groups > 1:
            ki, vi = ki.repeat_interleave(groups, 1), vi.repeat_interleave(groups, 1)
        t, s = b - a, e - c
        mask = None if t == s and not window else torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
        if window:
            mask &= torch.ones_like(mask).triu(s - t - window + 1)
        out.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=mask is None,
                                                  scale=scale)[0].transpose(0, 1))
    return torch.cat(out)


def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
_VARLEN_ATTN, _VARLEN_GQA = _torch_varlen()
_NATIVE_GQA: bool | None = None  # register_varlen_attention's probe: torch varlen_attn takes fewer KV heads unflagged


def _probe_native_gqa() -> bool:
    """torch 2.11's varlen_attn has no enable_gqa flag, but the flash kernels under it take fewer KV heads than
    query heads (as flash-attn's do), forward and backward, which saves expanding K and V (a copy of each per
    layer, and their gradients summed back). Use that only if a small case agrees with expanded heads, values
    and gradients, so a torch that rejects or mishandles it keeps the expansion. Runs eagerly, once."""
    if _VARLEN_ATTN is None or _VARLEN_GQA or not torch.cuda.is_available():
        return False
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        make = lambda h: torch.randn(40, h, 64, device="cuda", generator=g).bfloat16().requires_grad_()
        q, k, v = make(4), make(2), make(2)
        cu = torch.tensor([0, 17, 40], device="cuda", dtype=torch.int32)
        with torch.enable_grad():
            outs = [_VARLEN_ATTN(q, kk, vv, cu, cu, 23, 23, window_size=(-1, 0)) for kk, vv in
                    ((k, v), (k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)))]
            dout = torch.randn_like(outs[0])
            grads = [torch.autograd.grad(o, (q, k, v), dout) for o in outs]
        return all(torch.allclose(a.float(), b.float(), atol=1e-2, rtol=1e-2)
                   for a, b in zip((outs[0], *grads[0]), (outs[1], *grads[1])))
    except (RuntimeError, TypeError, ValueError):
        return False


def backend(device: torch.device, dtype: torch.dtype) -> str:
    """Which kernel the "varlen" attention runs for tensors on `device` in `dtype`."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        if _FLASH_ATTN:
            return "flash_attn"
        if _VARLEN_ATTN is not None:
            return "torch_varlen"
    return "reference"


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             sliding_window=None, **kwargs):
    """transformers attention function. query: (B, Hq, T, D), key/value: (B, Hkv, T, D) -> ((B, T, Hq, D), None).
    Attends causally within each sequence given by kwargs cu_seq_lens_q / max_length_q (FlashAttentionKwargs)
    or by the position-id restarts; attention_mask is ignored (packed rows carry no padding). With kwargs kv_index
    (common.packing.pack_shared), each segment's keys and values are the row's tokens kv_index lists, bounded by
    cu_seq_lens_k / max_length_k, aligned at the segment's end. sliding_window W (Gemma-3's local layers, Mistral,
    Phi-3): each query attends to its last W keys, itself included (flash-attn's window_size left = W - 1). With
    kwargs sequence_parallel (--sp-size), query/key/value hold this rank's tokens of the row and the boundaries are
    the whole row's: common.sequence_parallel's all-to-alls run around this function."""
    if dropout:
        raise NotImplementedError("--attn-impl varlen does not implement attention dropout; use sdpa")
    sp = kwargs.pop("sequence_parallel", None)
    if sp is not None:  # --sp-size: all-to-all to whole sequences of this rank's heads, attend, and back
        return sp.attention(varlen_attention_forward, module, query, key, value, attention_mask, scaling, dropout,
                            sliding_window, **kwargs)
    B, Hq, T, D = query.shape
    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None:
        pos = kwargs.get("position_ids")
        pos = pos if pos is not None else torch.arange(T, device=query.device)[None]
        cu, max_len = cu_seqlens_from_position_ids(pos.expand(B, T))
    q, k, v = (x.transpose(1, 2).reshape(B * T, x.shape[1], D) for x in (query, key, value))  # (N, H, D)
    cu = cu.to(device=q.device, dtype=torch.int32)
    cu_k, max_k, kv_index = cu, max_len, kwargs.get("kv_index")
    if kv_index is not None:  # shared prompts: gather each segment's keys (its prompt's, then its own)
        k, v = k[kv_index], v[kv_index]  # (N_k, Hkv, D)
        cu_k, max_k = kwargs["cu_seq_lens_k"].to(device=q.device, dtype=torch.int32), kwargs["max_length_k"]
    kind = backend(q.device, q.dtype)
    if kind == "flash_attn":
        from flash_attn import flash_attn_varlen_func
        out = flash_attn_varlen_func(q, k, v, cu, cu_k, max_len, max_k, softmax_scale=scaling, causal=True,
                                     **({"window_size": (sliding_window - 1, 0)} if sliding_window else {}))
    elif kind == "torch_varlen":
        gqa = {}
        if k.shape[1] != Hq:
            if _VARLEN_GQA:
                gqa = {"enable_gqa": True}
            elif not _NATIVE_GQA:  # no enable_gqa and the kernel did not pass the probe: expand the kv heads
                k, v = (x.repeat_interleave(Hq // x.shape[1], 1) for x in (k, v))
        left = sliding_window - 1 if sliding_window else -1
        out = _VARLEN_ATTN(q, k, v, cu, cu_k, max_len, max_k, scale=scaling, window_size=(left, 0), **gqa)
    else:
        out = reference_varlen_attention(q, k, v, cu, scaling, cu_k, sliding_window)
    return out.view(B, T, Hq, D), None


def register_varlen_attention() -> str:
    """Register "varlen" with transformers' AttentionInterface (idempotent); returns the name to pass as
    attn_implementation. On a GPU, also checks once whether torch's varlen_attn takes GQA heads unexpanded."""
    global _NATIVE_GQA
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, varlen_attention_forward)
    if _NATIVE_GQA is None and torch.cuda.is_available():  # once per process, whatever the answer
        _NATIVE_GQA = _probe_native_gqa()
    return NAME


def describe(device: torch.device, dtype: torch.dtype) -> str:
    """The kernel "varlen" runs on `device` in `dtype`, and how it handles grouped KV heads (for logs)."""
    kind = backend(device, dtype)
    if kind == "torch_varlen":
        return "torch varlen_attn, GQA " + ("enable_gqa" if _VARLEN_GQA else "native" if _NATIVE_GQA else
                                            "by expanding K/V")
    return {"flash_attn": "flash-attn varlen", "reference": "per-sequence sdpa (reference)"}[kind]


def attn_kwargs(mb) -> dict:
    """The sequence boundaries of a packed MicroBatch as the kwargs transformers forwards to every attention call
    (FlashAttentionKwargs): TokenLogProbs(..., **attn_kwargs(mb)). Harmless with sdpa, which ignores them, except for
    a pack_shared micro-batch, which only the varlen attention reads right (its kv_index)."""
    out = {"cu_seq_lens_q": mb.cu_seqlens, "cu_seq_lens_k": mb.cu_seqlens,
           "max_length_q": mb.max_seqlen, "max_length_k": mb.max_seqlen}
    if mb.kv_index is not None:  # pack_shared: keys of their own
        out |= {"cu_seq_lens_k": mb.cu_seqlens_k, "max_length_k": mb.max_seqlen_k, "kv_index": mb.kv_index}
    return out
