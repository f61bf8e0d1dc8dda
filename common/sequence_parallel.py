"""Sequence parallelism for the trainer, DeepSpeed-Ulysses form (Jacobs et al. 2023, https://arxiv.org/abs/2309.14509):
--sp-size N splits every packed micro-batch's tokens across the N ranks of a sequence-parallel (SP) group.

Each rank of a group holds 1/N of the row's tokens (the row padded to a multiple of N) and runs everything outside
attention on them: embeddings, norms, MLP, RoPE at the tokens' own positions, the LM head's log-prob / loss kernel.
Around attention an all-to-all trades the token split for a head split: each rank then holds every token of the row
for H/N query heads and KV/N key-value heads, runs the varlen attention over whole sequences (cu_seqlens, sliding
windows and pack_shared's kv_index of the whole row unchanged), and a second all-to-all trades back. The all-to-all is
an autograd Function whose backward is the inverse all-to-all. torch's gloo backend has all_to_all_single on CPU, as
NCCL has on GPU, so both run the same collective (no emulation).

Ranks and data: SP groups are N consecutive ranks (within a node); the ranks of a group share one data-parallel share
of the micro-batches (data-parallel size = world / N) and see the same packed micro-batch. FSDP is unchanged: it still
shards over all ranks (the same ranks, in the same order, as the flattened dp x sp dimension), so checkpoints have one
layout whatever --sp-size, and gradients are summed over all ranks as before: each rank's backward is its tokens' share.

Who computes the loss: per-token outputs (log-probs, entropies, values) are all-gathered, so every rank of a group
holds them for the whole row, but only the group's first rank keeps the micro-batch's rows (rank_view): it computes
the loss and the statistics over them; the other ranks see the micro-batch like a padding one (no rows, a zero loss
that still runs the backward). The gather's backward is a reduce-scatter, which hands every rank the first rank's
gradient for its own tokens. A fused loss (kernels.token_loss) is computed by every rank on its own tokens, with the
per-token constants of its slice (MicroBatch.take keeps them on every rank). So statistics count each token once and
the scripts need no change but the flag. docs/long_responses.md has the costs.
"""
import dataclasses
import os
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.attention import cu_seqlens_from_position_ids
from common.errors import UsageError
from common.packing import MicroBatch


class _AllToAll(torch.autograd.Function):
    """(N, ...) -> (N, ...): chunk j goes to rank j of the group, chunk i of the result came from rank i. Backward:
    the same exchange of the gradients, which sends each chunk's gradient back to the rank it came from."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), ctx.group), None


@torch.compiler.disable  # under --fsdp.compile: a graph break, the exchange and its backward run eagerly
def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    return _AllToAll.apply(x, group)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)  # equal splits of dim 0
    return out


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (same arguments); older torch has the old names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherTokens(torch.autograd.Function):
    """(L, k) this rank's tokens -> (N * L, k) the group's, in rank order. Backward: a reduce-scatter, each rank's
    slice of the gradients summed over the group (only the first rank's loss reads the rows: rank_view)."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group = group
        out = x.new_empty(size * x.shape[0], *x.shape[1:])
        _all_gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:])
        _reduce_scatter(out, grad.contiguous(), group=ctx.group)  # a sum
        return out, None, None


@dataclass(frozen=True, eq=False)
class SequenceParallel:
    """This rank's place in its SP group and the group's process group; the model roots (common.models.TokenLogProbs,
    ppo.py's ValueModel) hold one and call split() before the body and gather() after the head."""
    size: int    # N, --sp-size
    rank: int    # this rank's index in its group: it holds tokens [rank * L, (rank + 1) * L) of the padded row
    group: object = None  # the group's ProcessGroup

    def split(self, input_ids, position_ids, attn_kwargs: dict, targets=None, loss=None):
        """A packed row (1, T) -> this rank's slice (1, L), L = ceil(T / N): input ids, position ids and targets,
        the attention kwargs for the whole padded row (plus this object, which the varlen attention reads), and a
        TokenLoss cut to the scored tokens of the slice. The row is padded to N * L with a segment of its own
        (positions 0.., targets -100): its tokens attend only to each other and enter no loss."""
        T, N = input_ids.shape[1], self.size
        L = -(-T // N)
        pad = N * L - T
        dev = input_ids.device
        kw = dict(attn_kwargs)
        cu, longest = kw.get("cu_seq_lens_q"), kw.get("max_length_q")
        if cu is None:
            cu, longest = cu_seqlens_from_position_ids(position_ids)
        cu_k, longest_k, kv_index = kw.get("cu_seq_lens_k", cu), kw.get("max_length_k", longest), kw.get("kv_index")
        if pad:
            input_ids = F.pad(input_ids, (0, pad))
            position_ids = torch.cat([position_ids, torch.arange(pad, device=dev)[None]], 1)
            targets = None if targets is None else F.pad(targets, (0, pad), value=-100)
            cu = torch.cat([cu, cu.new_tensor([N * L])])
            cu_k = torch.cat([cu_k, cu_k.new_tensor([int(cu_k[-1]) + pad])]) if kv_index is not None else cu
            if kv_index is not None:  # pack_shared: the padding segment's keys are its own tokens
                kv_index = torch.cat([kv_index, torch.arange(T, N * L, device=dev)])
            longest, longest_k = max(int(longest), pad), max(int(longest_k), pad)
        kw |= {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu_k, "max_length_q": int(longest),
               "max_length_k": int(longest_k), "sequence_parallel": self}
        if kv_index is not None:
            kw["kv_index"] = kv_index
        lo, hi = self.rank * L, (self.rank + 1) * L
        if loss is not None:  # the fused loss's per-token constants: those of the scored tokens in [lo, hi)
            scored = (targets.flatten() != -100).nonzero().squeeze(1)  # (N_scored,) ascending
            a, b = torch.searchsorted(scored, torch.tensor([lo, hi], device=dev)).tolist()
            loss = loss.slice(a, b)
        cut = lambda x: None if x is None else x[:, lo:hi]
        return cut(input_ids), cut(position_ids), kw, cut(targets), loss

    def gather(self, outs: list[torch.Tensor], T: int) -> list[torch.Tensor]:
        """Per-token outputs (1, L) of this rank's slice -> (1, T) each, the whole row on every rank of the group
        (the padding dropped). Differentiable (_GatherTokens)."""
        local = torch.cat([x.float() for x in outs]).T  # (L, k)
        full = _GatherTokens.apply(local, self.group, self.size)[:T].T  # (k, T)
        return [full[i:i + 1].to(x.dtype, copy=True) for i, x in enumerate(outs)]  # not views (FSDP2 warns of those)

    def attention(self, attend, module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  sliding_window=None, **kwargs):
        """Ulysses attention around `attend` (common.attention.varlen_attention_forward). query (1, Hq, L, D),
        key / value (1, Hkv, L, D) for this rank's tokens -> all-to-all -> (1, H/N, N * L, D), the whole row for
        this rank's heads (q heads [r Hq/N, (r+1) Hq/N) and the KV heads they read under GQA) -> attend -> all-to-all
        back -> ((1, L, Hq, D), None)."""
        N = self.size
        _, Hq, L, D = query.shape
        Hkv = key.shape[1]
        split = lambda x: x[0].transpose(0, 1).reshape(L, N, x.shape[1] // N, D)  # (L, N, H/N, D): head groups
        qkv = torch.cat([split(x) for x in (query, key, value)], 2).transpose(0, 1)  # (N, L, (Hq + 2 Hkv) / N, D)
        qkv = _exchange(qkv.contiguous(), self.group).flatten(0, 1)  # (N L, C, D): every token, my heads
        q, k, v = (x.transpose(0, 1)[None] for x in qkv.split([Hq // N, Hkv // N, Hkv // N], 1))  # (1, h, N L, D)
        out, _ = attend(module, q, k, v, attention_mask, scaling=scaling, dropout=dropout,
                        sliding_window=sliding_window, **kwargs)  # (1, N L, Hq / N, D)
        out = _exchange(out[0].unflatten(0, (N, L)).contiguous(), self.group)  # (N, L, Hq/N, D): my tokens
        return out.transpose(0, 1).reshape(1, L, Hq, D), None


@lru_cache(maxsize=None)
def _group(size: int, device_type: str) -> SequenceParallel:
    """The (dp, sp) device mesh of the world, built once per process: SP groups are N consecutive ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device_type, (dist.get_world_size() // size, size), mesh_dim_names=("dp", "sp"))
    return SequenceParallel(size, mesh.get_local_rank("sp"), mesh.get_group("sp"))


def check(size: int, world: int, local_world: int, config=None, attn_impl: str = "varlen") -> None:
    """Refuse an SP geometry that cannot work, naming the flag to change. config: the model's (its heads)."""
    if size < 1:
        raise UsageError(f"--sp-size {size}: must be >= 1 (1: no sequence parallelism)")
    if size == 1:
        return
    if world % size:
        raise UsageError(f"--sp-size {size} must divide the number of ranks ({world}): the data-parallel size is "
                         f"ranks / --sp-size; change --sp-size or --nproc_per_node")
    if local_world % size:
        raise UsageError(f"--sp-size {size} must divide the ranks per node ({local_world}): an SP group runs two "
                         f"all-to-alls per layer and must sit within a node; lower --sp-size")
    if attn_impl != "varlen":
        raise UsageError(f"--sp-size {size} needs --attn-impl varlen (the all-to-alls wrap the varlen attention), "
                         f"not {attn_impl!r}")
    if config is not None:
        text = config.get_text_config()
        heads = text.num_attention_heads
        kv = getattr(text, "num_key_value_heads", None) or heads
        for what, n in (("attention heads", heads), ("key-value heads", kv)):
            if n % size:
                raise UsageError(f"--sp-size {size} must divide the model's {what} ({n}): each rank of an SP group "
                                 f"attends with 1/{size} of them; pick a divisor of {n} for --sp-size")


def sequence_parallel(size: int, config, attn_impl: str, device) -> SequenceParallel | None:
    """This rank's SequenceParallel for --sp-size `size` and a model with `config` (checked: check()), or None with
    size 1. Every rank must call it (the first call builds the process groups)."""
    world = dist.get_world_size()
    check(size, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), config, attn_impl)
    return _group(size, torch.device(device).type) if size > 1 else None


def of(models) -> SequenceParallel | None:
    """The SequenceParallel the models of one pass share (None: whole rows on each rank). A model without one
    (a replicated reference) cannot step through the same micro-batches as one with."""
    sps = {getattr(m, "sp", None) for m in models}
    if len(sps) > 1:
        raise ValueError("the models of one pass must share one --sp-size")
    return sps.pop() if sps else None


def data_parallel(models, world: int, rank: int) -> tuple[int, int]:
    """(world, rank) of the micro-batch sharding for `models`: with --sp-size N the N ranks of an SP group share one
    data-parallel share of the rows, (world / N, rank // N); without, (world, rank) as given."""
    sp = of(models)
    if sp is None:
        return world, rank
    if world % sp.size:
        raise ValueError(f"a pass over {world} rank(s) cannot hold SP groups of {sp.size}")
    return world // sp.size, rank // sp.size


def rank_view(models, mb: MicroBatch) -> MicroBatch:
    """The micro-batch as this rank uses it (module docstring): the first rank of an SP group keeps its rows; the
    others keep the tokens and the per-token constants of take(), but no rows (unpack, index and pos empty), so
    their loss and statistics are those of a padding micro-batch."""
    sp = of(models)
    if sp is None or sp.rank == 0:
        return mb
    return dataclasses.replace(mb, rows=[], row=mb.row[:0], col=mb.col[:0], pos=mb.pos[:0], index=mb.index[:0],
                               take_row=mb.index[mb.row], take_col=mb.col)


def table(size: int, world: int) -> dict:
    """Rows for the scripts' batch-geometry table."""
    return {"sequence parallel (--sp-size) x data parallel": f"{size} x {world // size}"}
