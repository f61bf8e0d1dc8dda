"""Padding-free batches: sequences concatenated into one row per micro-batch, cut by a token budget.

A packed row carries position ids that restart at 0 for each sequence; with attention_mask=None transformers
derives the block-diagonal causal mask from them (or, with a varlen attention kernel, cu_seqlens), so no
compute goes to padding and tokens never attend across sequences.
"""
from dataclasses import dataclass

import torch


@dataclass
class MicroBatch:
    input_ids: torch.Tensor     # (1, T) packed tokens
    position_ids: torch.Tensor  # (1, T) restart at 0 per sequence
    targets: torch.Tensor       # (1, T) next token at positions that predict a response token, -100 elsewhere
    cu_seqlens: torch.Tensor    # (n+1,) int32 sequence boundaries in the row
    max_seqlen: int
    rows: list[int]             # which sequences of the caller's batch are in this micro-batch
    row: torch.Tensor           # (N_resp,) index into `rows` of each response token
    col: torch.Tensor           # (N_resp,) position of each response token within its response
    pos: torch.Tensor           # (N_resp,) position in the packed row that predicts it (ascending)
    index: torch.Tensor         # (len(rows),) `rows` as a tensor: selects this micro-batch's rows on the device

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device):
        """On a GPU the copies go from pinned memory without blocking: a plain copy from pageable memory waits for
        the GPU to drain, which at every micro-batch would leave it idle while Python packs and launches."""
        device = torch.device(device)
        move = (lambda t: t.pin_memory().to(device, non_blocking=True)) if device.type == "cuda" else \
            (lambda t: t.to(device))
        return MicroBatch(*(move(getattr(self, f)) if isinstance(getattr(self, f), torch.Tensor)
                            else getattr(self, f) for f in self.__dataclass_fields__))

    def unpack(self, values: torch.Tensor, width: int) -> torch.Tensor:
        """Per-token values of the packed row (1, T) -> (len(rows), width) aligned with the responses, 0 after
        each response's end. Differentiable."""
        out = values.new_zeros(len(self.rows), width)
        return out.index_put((self.row, self.col), values[0, self.pos])

    def take(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """The other way: per-sequence (B,) or per-token (B, width) values of the caller's whole batch (rows indexed
        as in `rows`) -> (N_resp,), one per response token in the packed order of `pos`. None stays None."""
        if values is None:
            return None
        r = self.index[self.row]  # (N_resp,) the caller's row of each response token
        return values[r, self.col] if values.dim() == 2 else values[r]


def balanced_partition(lengths: list[int], k: int) -> list[list[int]]:
    """Split item indices into k groups of near-equal total length (greedy longest-first), each group sorted.
    Deterministic, so every rank computes the same partition from the same lengths."""
    groups: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        g = min(range(k), key=lambda g: (loads[g], len(groups[g]), g))
        groups[g].append(i)
        loads[g] += lengths[i]
    return [sorted(g) for g in groups]


def pack(prompts: list[list[int]], responses: list[list[int]], rows: list[int]) -> MicroBatch:
    """Pack the given sequences (prompt + response each) into one row. An empty `rows` gives a one-token dummy
    micro-batch whose targets are all ignored: ranks with fewer micro-batches run it so that every rank makes
    the same number of FSDP forward/backward calls."""
    ids, pos_ids, tgt, cu, row, col, pos = [], [], [], [0], [], [], []
    for r, i in enumerate(rows):
        p, a = prompts[i], responses[i]
        seq = p + a
        off = len(ids)
        ids += seq
        pos_ids += range(len(seq))
        t = [-100] * len(seq)
        for j in range(len(a)):  # token p+j is predicted at position p+j-1
            t[len(p) + j - 1] = a[j]
            row.append(r)
            col.append(j)
            pos.append(off + len(p) + j - 1)
        tgt += t
        cu.append(len(ids))
    if not rows:
        ids, pos_ids, tgt, cu = [0], [0], [-100], [0, 1]
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    long = lambda x: torch.tensor(x, dtype=torch.long)
    return MicroBatch(long(ids)[None], long(pos_ids)[None], long(tgt)[None], torch.tensor(cu, dtype=torch.int32),
                      max(lens), list(rows), long(row), long(col), long(pos), long(list(rows)))


def pack_masked(seqs: list[list[int]], masks: list[list[bool]], rows: list[int]) -> MicroBatch:
    """Pack whole sequences into one row with targets on the tokens their mask marks, wherever they are (sft.py: the
    assistant turns of a conversation). Token j is predicted at position j - 1, so mask[0] is never a target; col is
    each target's position in its sequence. An empty `rows` gives pack's one-token dummy micro-batch."""
    if not rows:
        return pack([], [], [])
    ids, pos_ids, tgt, cu, row, col, pos = [], [], [], [0], [], [], []
    for r, i in enumerate(rows):
        off, s = len(ids), seqs[i]
        ids += s
        pos_ids += range(len(s))
        tgt += [-100] * len(s)
        for j in range(1, len(s)):
            if masks[i][j]:
                tgt[off + j - 1] = s[j]
                row.append(r)
                col.append(j)
                pos.append(off + j - 1)
        cu.append(len(ids))
    long = lambda x: torch.tensor(x, dtype=torch.long)
    return MicroBatch(long(ids)[None], long(pos_ids)[None], long(tgt)[None], torch.tensor(cu, dtype=torch.int32),
                      max(len(seqs[i]) for i in rows), list(rows), long(row), long(col), long(pos), long(list(rows)))


def plan_microbatches(lengths: list[int], rows: list[int], max_tokens: int) -> list[list[int]]:
    """Group `rows` (indices into `lengths`) into micro-batches of at most max_tokens tokens each
    (first-fit decreasing). A sequence longer than the budget is an error naming the flag."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(rows, key=lambda i: (-lengths[i], i)):
        if lengths[i] > max_tokens:
            raise ValueError(f"a sequence of {lengths[i]} tokens does not fit --max-tokens-per-microbatch "
                             f"{max_tokens}; raise it to at least max prompt + max new tokens")
        for b in range(len(bins)):
            if loads[b] + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def shard_microbatches(lengths: list[int], rows: list[int], world_size: int, rank: int,
                       max_tokens: int) -> list[list[int]]:
    """This rank's micro-batches for a set of sequences every rank knows: balanced by tokens across ranks, cut
    by the token budget, then padded with empty micro-batches to the same count on every rank."""
    parts = balanced_partition([lengths[i] for i in rows], world_size)
    plans = [plan_microbatches(lengths, [rows[j] for j in part], max_tokens) for part in parts]
    n = max(len(p) for p in plans)
    mine = plans[rank]
    return mine + [[] for _ in range(n - len(mine))]
