"""Setup the RL scripts (grpo.py, ppo.py) share, run once before the loop: checking the batch geometry, the
derived geometry for the table printed at start, and the prompts. Each takes the script's Args, whose field names
the two scripts share (the flags its error messages name)."""
import math
import os

import torch

from common.attention import describe
from common.data import build_prompts, load_rows
from common.models import resolve_model


SIZES = (("num_steps", 0), ("prompts_per_step", 1), ("eval_size", 0), ("eval_n", 0), ("max_prompt_tokens", 1),
         ("max_new_tokens", 1), ("num_minibatches", 1), ("num_epochs", 1), ("max_tokens_per_microbatch", 1),
         ("max_tokens_per_forward", 0), ("lr", 0), ("warmup_steps", 0), ("keep_last", 1),
         ("kl_horizon", 1))  # (flag, least value)


def check_geometry(args, world_size: int, sizes: tuple = ()) -> None:
    """The batch geometry of grpo.py / ppo.py `args`, checked before anything expensive; each error names the flag
    to change. sizes: the script's own (field, least value) pairs, checked with SIZES."""
    for name, least in SIZES + tuple(sizes):
        if not getattr(args, name) >= least:  # `not >=`: NaN fails too
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= {least}")
    if args.loss_agg not in ("token-mean", "seq-mean-token-sum-norm", "seq-mean-token-mean", "seq-mean-token-sum-verl",
                             "seq-mean-token-sum"):
        raise ValueError(f"--loss-agg {args.loss_agg!r}: use token-mean, seq-mean-token-sum-norm, seq-mean-token-mean "
                         "or seq-mean-token-sum-verl")
    if args.loss_agg == "seq-mean-token-sum" and os.environ.get("RANK", "0") == "0":  # the old name keeps its meaning
        print("--loss-agg seq-mean-token-sum is deprecated: it still means seq-mean-token-sum-norm (each sequence's "
              "token sum / --max-new-tokens, Dr. GRPO), so this run is unchanged; write seq-mean-token-sum-norm. "
              "verl's seq-mean-token-sum (the token sum, no division) is --loss-agg seq-mean-token-sum-verl", flush=True)
    if args.dual_clip_c and not args.dual_clip_c > 1:
        raise ValueError(f"--dual-clip-c {args.dual_clip_c}: use 0 (off) or a bound c > 1 (verl's default is 3.0)")
    if (args.kl_target > 0 or getattr(args, "kl_in_reward", False)) and not args.kl_coef > 0:
        raise ValueError("--kl-target and --kl-in-reward need a --kl-coef > 0 (the controller scales it; 0 stays 0, "
                         "and kl_coef 0 loads no reference model)")
    if getattr(args, "dynamic_sampling_max_rounds", 1) > 1 and not args.dynamic_sampling:
        raise ValueError("--dynamic-sampling-max-rounds > 1 re-samples only with --dynamic-sampling: add it, or drop it")
    if args.prompts_per_step % world_size:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} must be divisible by the number of ranks "
                         f"({world_size}): each rank generates for its share of the prompts")
    if args.sequences_per_step % args.num_minibatches or args.sequences_per_minibatch < world_size:
        raise ValueError(f"--num-minibatches {args.num_minibatches} must divide the {args.sequences_per_step} "
                         f"sequences per step into mini-batches of at least {world_size} (one per rank)")
    if args.engine_logprobs_every < 0:
        raise ValueError(f"--engine-logprobs-every {args.engine_logprobs_every}: give k >= 0 (0: never, 1: every step)")
    if not args.temperature > 0:
        raise ValueError(f"--temperature {args.temperature}: training samples and scores log-probs at this temperature, "
                         "so it must be > 0 (evaluation is already greedy)")
    if args.max_tokens_per_microbatch < args.max_prompt_tokens + args.max_new_tokens:
        raise ValueError(f"--max-tokens-per-microbatch {args.max_tokens_per_microbatch} is smaller than one "
                         f"sequence (--max-prompt-tokens + --max-new-tokens = "
                         f"{args.max_prompt_tokens + args.max_new_tokens}); raise it")
    if args.forward_token_budget < args.max_prompt_tokens + args.max_new_tokens:
        raise ValueError(f"--max-tokens-per-forward {args.max_tokens_per_forward} is smaller than one sequence "
                         f"({args.max_prompt_tokens + args.max_new_tokens} tokens); raise it, or 0 for the default")


def geometry_rows(args, world_size: int, device) -> dict:
    """The derived batch geometry of grpo.py / ppo.py `args`, for the table printed at start."""
    seqs_per_rank_mb = args.sequences_per_minibatch / world_size
    return {
        "prompts / rank": args.prompts_per_step // world_size,
        "mini-batches x epochs": f"{args.num_minibatches} x {args.num_epochs}",
        "optimiser steps / rollout": args.optimizer_steps_per_rollout,
        "sequences / mini-batch / rank": seqs_per_rank_mb,
        "micro-batch token budget": args.max_tokens_per_microbatch,
        "no-grad forward token budget": args.forward_token_budget,
        "grad accumulation / rank (max)": math.ceil(seqs_per_rank_mb * (args.max_prompt_tokens + args.max_new_tokens)
                                                    / args.max_tokens_per_microbatch),
        "trainer attention": describe(device, torch.bfloat16) if args.attn_impl == "varlen" else args.attn_impl,
    }


def load_prompt_splits(args, tok, rank: int, world_size: int):
    """The train prompts of grpo.py / ppo.py `args` (and how many were dropped as too long) and this rank's share
    of the held-out ones."""
    def prompts_of(split):
        rows = load_rows(args.dataset, split, args.dataset_config)
        return build_prompts(rows, tok, args.prompt_field, args.answer_field, args.instruction,
                             args.max_prompt_tokens, args.chat_template)
    train, dropped = prompts_of(args.train_split)
    evals = prompts_of(args.eval_split)[0][:args.eval_size][rank::world_size] if args.eval_every else []
    return train, dropped, evals


def resolve_model_once(spec: str, is_main: bool) -> str:
    """common.models.resolve_model on rank 0 first (a GGUF is converted once, into the cache), then on the first
    rank of every other node (which finds the converted folder when $RL_CACHE is on a shared file system, else
    converts its own node's copy), then on the remaining ranks, which find it."""
    first_of_node = int(os.environ.get("LOCAL_RANK", 0)) == 0
    path = resolve_model(spec) if is_main else None
    torch.distributed.barrier()
    if first_of_node and not is_main:
        path = resolve_model(spec)
    torch.distributed.barrier()
    return path or resolve_model(spec)
