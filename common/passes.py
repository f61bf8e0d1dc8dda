"""Passes of a model over a batch every rank holds: the no-grad log-prob and value passes (each rank takes a
balanced share of the sequences, the results are summed back so every rank has them all), and the micro-batch
loop of an update (this rank's packed micro-batches, with FSDP2 told when to reduce-scatter and reshard).
A model built with share_prompts (TokenLogProbs; the RL scripts' --share-prompts with the varlen attention) gets
micro-batches that hold each prompt once for the sequences that share it (common.packing.pack_shared). With --sp-size N
(models holding a common.sequence_parallel.SequenceParallel) the N ranks of an SP group take one data-parallel share
and see the same micro-batches, whose rows only the group's first rank keeps (sequence_parallel.rank_view)."""
from typing import Iterator

import torch
from torch import nn

from common import dist as D
from common.attention import attn_kwargs
from common.fsdp import ShardPlan, reshard
from common.packing import MicroBatch, pack, pack_shared, shard_microbatches, shard_shared_microbatches
from common.sequence_parallel import data_parallel, rank_view


def _lengths(prompts, responses) -> list[int]:
    return [len(p) + len(r) for p, r in zip(prompts, responses)]


def _shares(models) -> bool:
    """Whether every model of a pass takes pack_shared micro-batches (built with share_prompts)."""
    return all(getattr(m, "share_prompts", False) for m in models)


def _packed(shared: bool, prompts, responses, rows, world: int, rank: int, budget: int):
    """This rank's micro-batches of `rows` and how to pack them: shared prompts, or every sequence whole."""
    if shared:
        return shard_shared_microbatches(prompts, responses, rows, world, rank, budget), pack_shared
    return shard_microbatches(_lengths(prompts, responses), rows, world, rank, budget), pack


@torch.no_grad()
def sequence_logprobs(model, prompts, responses, rows, world, rank, budget, temperature, width, device):
    """log pi(response token) for `rows` of the global batch, computed across ranks (each takes a balanced share)
    and summed back so every rank holds the result: (B, width), zero outside `rows`. world=1, rank=0 on one of
    several ranks: all of `rows` on this rank and no collective (a replicated model)."""
    out = torch.zeros(len(prompts), width, device=device)
    micro, packer = _packed(_shares([model]), prompts, responses, rows, *data_parallel([model], world, rank), budget)
    for mb_rows in micro:
        mb = rank_view([model], packer(prompts, responses, mb_rows)).to(device)
        logp, _ = model(mb.input_ids, mb.position_ids, mb.targets, temperature, scored=mb.pos, **attn_kwargs(mb))
        if mb_rows:
            out[mb.index] = mb.unpack(logp, width)
    reshard(model)  # FSDP2 leaves gathered parameters after a forward without backward; stale after a step
    return D.all_reduce(out) if world > 1 else out  # world 1: this rank's rows alone, no collective


def rollout_logprobs(model, prompts, responses, budget, temperature, width, device) -> torch.Tensor:
    """log pi(response token) of every sequence of this rank's rollout, computed on this rank alone (a replicated
    model): (B_rank, T) on the CPU, to travel in the rollout gather."""
    return sequence_logprobs(model, prompts, responses, list(range(len(prompts))), 1, 0, budget, temperature, width,
                             device).cpu()


@torch.no_grad()
def sequence_values(critic, prompts, responses, rows, world, rank, budget, width, device):
    """V(s_t) per response token and V(s_T) after each sequence's last token for `rows` of the global batch,
    computed across ranks like sequence_logprobs. Returns (B, width) and (B,), zero outside `rows`."""
    values = torch.zeros(len(prompts), width, device=device)
    last = torch.zeros(len(prompts), device=device)
    world, rank = data_parallel([critic], world, rank)
    for mb_rows in shard_microbatches(_lengths(prompts, responses), rows, world, rank, budget):
        mb = rank_view([critic], pack(prompts, responses, mb_rows)).to(device)
        v = critic(mb.input_ids, mb.position_ids, **attn_kwargs(mb))
        if mb.rows:  # none on a padding micro-batch, or on an SP group's other ranks
            values[mb.index] = mb.unpack(v, width)
            last[mb.index] = v[0, mb.cu_seqlens[1:].long() - 1]  # each sequence's final position
    reshard(critic)  # FSDP2 leaves gathered parameters after a forward without backward; stale after a step
    return D.all_reduce(values), D.all_reduce(last)


def microbatch_rows(models: list[tuple[nn.Module, ShardPlan]], lengths: list[int], rows: list[int], world: int,
                    rank: int, budget: int) -> Iterator[list[int]]:
    """This rank's micro-batches of `rows` (one mini-batch of a global batch every rank holds, balanced across ranks
    by tokens; `lengths` weighs every row), each a list of row ids for the caller to pack, forward and backward.
    Every rank yields the same number: a rank with fewer gets empty ones, whose forward and backward make the same
    FSDP2 calls and add a zero gradient (a loss over no rows is 0 and still depends on the parameters). Gradients
    are reduce-scattered once, after the last backward; with a plan's keep_gathered the parameters stay gathered
    from the first forward to the last backward. With --sp-size the caller's packed micro-batch goes through
    common.sequence_parallel.rank_view (the ranks of an SP group get the same row ids)."""
    world, rank = data_parallel([m for m, _ in models], world, rank)
    yield from _turns(models, shard_microbatches(lengths, rows, world, rank, budget))


def _turns(models: list[tuple[nn.Module, ShardPlan]], micro: list[list[int]]) -> Iterator[list[int]]:
    """microbatch_rows' loop over given micro-batches: FSDP2 reduce-scatters and reshards after the last."""
    for i, mb_rows in enumerate(micro):
        last = i == len(micro) - 1
        for model, plan in models:
            model.set_requires_gradient_sync(last)  # reduce-scatter once per mini-batch
            model.set_reshard_after_backward(last or not plan.keep_gathered)  # all-gather once per mini-batch
        yield mb_rows


def minibatch_order(rows: list[int], num_epochs: int, num_minibatches: int, gen: torch.Generator):
    """(epoch, mini-batch) pairs of an update: each epoch shuffles `rows` with `gen`, then deals them into
    num_minibatches mini-batches (row i goes to mini-batch i mod num_minibatches); empty ones are skipped."""
    for epoch in range(num_epochs):
        order = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
        for minibatch in (order[i::num_minibatches] for i in range(num_minibatches)):
            if minibatch:
                yield epoch, minibatch


def microbatches(models: list[tuple[nn.Module, ShardPlan]], prompts, responses, rows, world: int, rank: int,
                 budget: int, device) -> Iterator[MicroBatch]:
    """microbatch_rows of (prompt, response) sequences, packed and on the device (prompts shared when every model
    takes it)."""
    world, rank = data_parallel([m for m, _ in models], world, rank)
    micro, packer = _packed(_shares([m for m, _ in models]), prompts, responses, rows, world, rank, budget)
    for mb_rows in _turns(models, micro):
        yield rank_view([m for m, _ in models], packer(prompts, responses, mb_rows)).to(device)
