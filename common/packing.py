"""Padding-free batches: sequences concatenated into one row per micro-batch, cut by a token budget.

A packed row carries position ids that restart at 0 for each sequence; with attention_mask=None transformers
derives the block-diagonal causal mask from them (or, with a varlen attention kernel, cu_seqlens), so no
compute goes to padding and tokens never attend across sequences.

Shared prompts (pack_shared, the RL scripts' default with the varlen attention): the sequences of a GRPO group share
their prompt, so a micro-batch holds it once. The row then has one segment of the prompt but its last token, and per
sequence a segment of that last token followed by the response, whose keys are the prompt's segment and its own
(kv_index gathers them per layer; common/attention.py). Every query sees the keys and positions it would see in the
whole sequence, so the log-probs are the same; the prompt's layers run once instead of once per sequence. The last
prompt token is repeated so that each of its copies predicts one response's first token: every scored position
keeps one target, and the rest of the machinery (targets, pos, unpack) is unchanged.
"""
from dataclasses import dataclass

import torch

from common.errors import UsageError


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
    kv_index: torch.Tensor | None = None     # pack_shared: (N_k,) the row's tokens each segment attends to, in order
    cu_seqlens_k: torch.Tensor | None = None  # pack_shared: (n+1,) int32 boundaries of the segments' keys in kv_index
    max_seqlen_k: int = 0
    take_row: torch.Tensor | None = None  # (N_resp,) take()'s rows and columns where row / col were emptied
    take_col: torch.Tensor | None = None  # (common.sequence_parallel.rank_view)

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
        r = self.index[self.row] if self.take_row is None else self.take_row  # (N_resp,) the caller's row of each
        c = self.col if self.take_col is None else self.take_col  # response token, and its column
        return values[r, c] if values.dim() == 2 else values[r]


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


def pack_shared(prompts: list[list[int]], responses: list[list[int]], rows: list[int]) -> MicroBatch:
    """pack's micro-batch with each prompt held once for the rows that share it (the module's docstring): per distinct
    prompt P, one segment P[:-1], then per row a segment [P[-1]] + response that attends to P[:-1] and to itself.
    Positions continue from the prompt, so rotary embeddings match the whole sequence. `rows` of the result are in
    layout order (grouped by prompt); pos stays ascending. An empty `rows` gives pack's dummy micro-batch."""
    if not rows:
        return pack([], [], [])
    groups: dict[tuple, list[int]] = {}
    for i in rows:
        if not prompts[i]:
            raise ValueError(f"sequence {i} has an empty prompt; shared-prompt packing needs at least one prompt token")
        groups.setdefault(tuple(prompts[i]), []).append(i)
    ids, pos_ids, tgt, cu, kv, cu_k, row, col, pos, order = [], [], [], [0], [], [0], [], [], [], []
    for prompt, members in groups.items():
        n = len(prompt) - 1
        head = list(range(len(ids), len(ids) + n))  # the row's positions of P[:-1]
        if n:
            ids += prompt[:-1]
            pos_ids += range(n)
            tgt += [-100] * n
            cu.append(len(ids))
            kv += head
            cu_k.append(len(kv))
        for i in members:
            a, off = responses[i], len(ids)
            ids += [prompt[-1], *a]
            pos_ids += range(n, n + 1 + len(a))
            tgt += [*a, -100]  # position off + j predicts a[j]
            row += [len(order)] * len(a)
            col += range(len(a))
            pos += range(off, off + len(a))
            order.append(i)
            cu.append(len(ids))
            kv += head + list(range(off, len(ids)))
            cu_k.append(len(kv))
    long = lambda x: torch.tensor(x, dtype=torch.long)
    seg = lambda c: max(b - a for a, b in zip(c[:-1], c[1:]))
    return MicroBatch(long(ids)[None], long(pos_ids)[None], long(tgt)[None], torch.tensor(cu, dtype=torch.int32),
                      seg(cu), order, long(row), long(col), long(pos), long(order), long(kv),
                      torch.tensor(cu_k, dtype=torch.int32), seg(cu_k))


def prompt_units(prompts: list[list[int]], responses: list[list[int]], rows: list[int],
                 max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """`rows` in units that share a prompt (a group, in the order of first appearance), a unit cut where its shared
    layout would pass max_tokens, and each unit's tokens in pack_shared's layout (the prompt but its last token once,
    then the last token and the response per row). A single sequence over the budget stays a unit (plan_microbatches
    rejects it)."""
    groups: dict[tuple, list[int]] = {}
    for i in rows:
        groups.setdefault(tuple(prompts[i]), []).append(i)
    units, sizes = [], []
    for prompt, members in groups.items():
        unit: list[int] = []
        tokens = len(prompt) - 1
        for i in members:
            if unit and tokens + len(responses[i]) + 1 > max_tokens:
                units.append(unit)
                sizes.append(tokens)
                unit, tokens = [], len(prompt) - 1
            unit.append(i)
            tokens += len(responses[i]) + 1
        units.append(unit)
        sizes.append(tokens)
    return units, sizes


def shard_shared_microbatches(prompts: list[list[int]], responses: list[list[int]], rows: list[int], world_size: int,
                              rank: int, max_tokens: int) -> list[list[int]]:
    """shard_microbatches for pack_shared: the rows of a prompt stay together (balanced and binned as units weighed
    by their shared layout), so each micro-batch holds a prompt once for as many of its rows as fit."""
    units, sizes = prompt_units(prompts, responses, rows, max_tokens)
    micro = shard_microbatches(sizes, list(range(len(units))), world_size, rank, max_tokens)
    return [sorted(i for u in mb for i in units[u]) for mb in micro]


def plan_microbatches(lengths: list[int], rows: list[int], max_tokens: int) -> list[list[int]]:
    """Group `rows` (indices into `lengths`) into micro-batches of at most max_tokens tokens each
    (first-fit decreasing). A sequence longer than the budget is an error naming the flag."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(rows, key=lambda i: (-lengths[i], i)):
        if lengths[i] > max_tokens:
            raise UsageError(f"a sequence of {lengths[i]} tokens does not fit --max-tokens-per-microbatch "
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
