"""Setup the RL scripts (grpo.py, ppo.py) share, run once before the loop: checking the batch geometry, the
policy and its reference, the prompts, the rollout engine, resuming, the tracker and the table printed at start.
Each takes the script's Args, whose field names the two scripts share (the flags its error messages name)."""
import math
import os
from pathlib import Path

import torch

from common import checkpoint as C
from common import dist as D
from common import lora
from common.attention import describe
from common.data import build_prompts, chat_template_kwargs, load_splits
from common.engine_process import EngineProcess, check_engine_args, child_gpu, placement, resolve_num_engines
from common.env import make_env
from common.errors import UsageError
from common.fsdp import copy_params, place_frozen, shard
from common.lifecycle import plan_run
from common.membudget import resolve_microbatch  # noqa: F401  the scripts' one lazy setup step (at the first update)
from common.models import TokenLogProbs, eos_token_ids, load_causal_lm, load_tokenizer, resolve_model
from common.passes import sequence_logprobs
from common.rollout import make_engine
from common.sequence_parallel import check as check_sp, sequence_parallel, table as sp_table
from common.tracking import make_tracker, print_table, timed, to_dict


SIZES = (("num_steps", 0), ("prompts_per_step", 1), ("eval_size", 0), ("eval_n", 0), ("max_prompt_tokens", 1),
         ("max_new_tokens", 1), ("num_minibatches", 1), ("num_epochs", 1), ("max_tokens_per_microbatch", 0),
         ("max_tokens_per_forward", 0), ("lr", 0), ("warmup_steps", 0), ("keep_last", 1),
         ("kl_horizon", 1))  # (flag, least value)


def check_geometry(args, world_size: int, sizes: tuple = ()) -> None:
    """The batch geometry of grpo.py / ppo.py `args`, checked before anything expensive; each error names the flag
    to change. sizes: the script's own (field, least value) pairs, checked with SIZES."""
    for name, least in SIZES + tuple(sizes):
        if not getattr(args, name) >= least:  # `not >=`: NaN fails too
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= {least}")
    if args.loss_agg not in ("token-mean", "seq-mean-token-sum-norm", "seq-mean-token-mean", "seq-mean-token-sum-verl",
                             "seq-mean-token-sum"):
        raise UsageError(f"--loss-agg {args.loss_agg!r}: use token-mean, seq-mean-token-sum-norm, seq-mean-token-mean "
                         "or seq-mean-token-sum-verl")
    if args.loss_agg == "seq-mean-token-sum" and os.environ.get("RANK", "0") == "0":  # the old name keeps its meaning
        print("--loss-agg seq-mean-token-sum is deprecated: it still means seq-mean-token-sum-norm (each sequence's "
              "token sum / --max-new-tokens, Dr. GRPO), so this run is unchanged; write seq-mean-token-sum-norm. "
              "verl's seq-mean-token-sum (the token sum, no division) is --loss-agg seq-mean-token-sum-verl", flush=True)
    if getattr(args, "kl_estimator", "k3") not in ("k1", "k2", "k3", "k1+", "k3+", "abs"):  # Args built in code
        raise UsageError(f"--kl-estimator {args.kl_estimator!r}: use k1, k2 or k3, or k1+, k3+, abs")
    if args.dual_clip_c and not args.dual_clip_c > 1:
        raise UsageError(f"--dual-clip-c {args.dual_clip_c}: use 0 (off) or a bound c > 1 (verl's default is 3.0)")
    if (args.kl_target > 0 or getattr(args, "kl_in_reward", False)) and not args.kl_coef > 0:
        raise UsageError("--kl-target and --kl-in-reward need a --kl-coef > 0 (the controller scales it; 0 stays 0, "
                         "and kl_coef 0 loads no reference model)")
    if getattr(args, "dynamic_sampling_max_rounds", 1) > 1 and not args.dynamic_sampling:
        raise UsageError("--dynamic-sampling-max-rounds > 1 re-samples only with --dynamic-sampling: add it, or drop it")
    check_sp(args.sp_size, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), None, args.attn_impl)
    if args.sp_size > 1 and args.reference == "replicated":
        raise UsageError(f"--reference replicated scores each sequence whole on one rank, without --sp-size "
                         f"{args.sp_size}'s groups: use --reference sharded (auto is sharded with --sp-size > 1)")
    if args.prompts_per_step % world_size:
        raise UsageError(f"--prompts-per-step {args.prompts_per_step} must be divisible by the number of ranks "
                         f"({world_size}): each rank generates for its share of the prompts")
    if args.sequences_per_step % args.num_minibatches or args.sequences_per_minibatch < world_size:
        raise UsageError(f"--num-minibatches {args.num_minibatches} must divide the {args.sequences_per_step} "
                         f"sequences per step into mini-batches of at least {world_size} (one per rank)")
    if args.engine_logprobs_every < 0:
        raise UsageError(f"--engine-logprobs-every {args.engine_logprobs_every}: give k >= 0 (0: never, 1: every step)")
    if not args.temperature > 0:
        raise UsageError(f"--temperature {args.temperature}: training samples and scores log-probs at this temperature, "
                         "so it must be > 0 (evaluation is already greedy)")
    longest = args.longest_sequence
    if 0 < args.max_tokens_per_microbatch < longest:  # 0 (auto) is sized at the first update, at least `longest`
        raise UsageError(f"--max-tokens-per-microbatch {args.max_tokens_per_microbatch} is smaller than one "
                         f"sequence (--max-prompt-tokens + {'--max-episode-tokens' if args.env else '--max-new-tokens'}"
                         f" = {longest}); raise it")
    if args.max_tokens_per_forward and args.forward_token_budget < longest:
        raise UsageError(f"--max-tokens-per-forward {args.max_tokens_per_forward} is smaller than one sequence "
                         f"({longest} tokens); raise it, or 0 for the default")


def geometry_rows(args, world_size: int, device) -> dict:
    """The derived batch geometry of grpo.py / ppo.py `args`, for the table printed at start."""
    seqs_per_rank_mb = args.sequences_per_minibatch / (world_size // args.sp_size)  # per data-parallel rank
    auto = "auto (resolved at the first update)"
    mb = args.max_tokens_per_microbatch
    return {
        "prompts / rank": args.prompts_per_step // world_size,
        "mini-batches x epochs": f"{args.num_minibatches} x {args.num_epochs}",
        "optimiser steps / rollout": args.optimizer_steps_per_rollout,
        "sequences / mini-batch / rank": seqs_per_rank_mb,
        "micro-batch token budget": mb or auto,
        "no-grad forward token budget": args.forward_token_budget if mb or args.max_tokens_per_forward else
        f"4 x micro-batch, {auto}",
        "grad accumulation / rank (max)": math.ceil(seqs_per_rank_mb * args.longest_sequence / mb) if mb else auto,
        "trainer attention": describe(device, torch.bfloat16) if args.attn_impl == "varlen" else args.attn_impl,
        **sp_table(args.sp_size, world_size),
    }


def load_prompt_splits(args, tok, rank: int, world_size: int):
    """The train prompts of grpo.py / ppo.py `args`, how many were dropped as too long, this rank's share of the
    held-out ones, and where those come from (common.data.load_splits: a single file's held-out rows are never
    trained on)."""
    def prompts_of(rows):
        return build_prompts(rows, tok, args.prompt_field, args.answer_field, args.instruction,
                             args.max_prompt_tokens, args.chat_template, args.system_prompt,
                             chat_template_kwargs(args.chat_template_kwargs))
    evaluating = args.eval_every or not args.num_steps  # --num-steps 0: an evaluation alone
    splits = load_splits(args.dataset, args.train_split, args.eval_split, args.dataset_config, args.eval_fraction,
                         args.seed, need_eval=evaluating)
    train, dropped = prompts_of(splits.train)
    if evaluating and not len(splits.eval):
        raise UsageError(f"the run evaluates held-out prompts (--eval-every {args.eval_every}, --num-steps "
                         f"{args.num_steps}), but none are held out of {args.dataset} (--eval-fraction "
                         f"{args.eval_fraction}; rows are held out only while others are left to train on): raise "
                         "--eval-fraction, add rows, or pass --eval-every 0")
    evals = prompts_of(splits.eval[:args.eval_size])[0][rank::world_size] if evaluating else []
    return train, dropped, evals, splits.note


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


def load_policy(args, model_path: str, device):
    """The tokenizer, its stop ids, the policy LM sharded with its log-prob root (FSDP2, common.fsdp.shard) and,
    only when the KL term is on (--kl-coef > 0), the frozen reference placed as --reference says (sharded, or a
    whole copy per rank scored before the gather: ref_early). Returns tok, stop_ids, lm, policy, plan, ref,
    ref_early (ref None without a KL term). With --lora.rank r > 0 the policy trains LoRA adapters on a frozen base,
    and the reference is that base, the policy with its adapters off (common.lora.BaseView): no second copy."""
    tok = load_tokenizer(model_path)
    lm = lora.apply(load_causal_lm(model_path, args.attn_impl), args.lora, args.fsdp, device, args.seed)
    share, sp = args.prompt_sharing, sequence_parallel(args.sp_size, lm.config, args.attn_impl, device)  # --sp-size
    policy, plan = shard(lm, args.fsdp, device, root=TokenLogProbs(lm, args.logprob_impl, share_prompts=share, sp=sp))
    ref, ref_early = None, False
    if args.kl_coef > 0 and args.lora.rank:
        ref = lora.base_view(policy)
    elif args.kl_coef > 0:  # with --sp-size the reference is sharded, in the policy's SP groups
        rlm = load_causal_lm(model_path, args.attn_impl, trainable=False)
        ref, ref_early = place_frozen(rlm, args.fsdp, device, "sharded" if sp else args.reference,
                                      root=TokenLogProbs(rlm, args.logprob_impl, share_prompts=share, sp=sp))
    return tok, eos_token_ids(tok, model_path), lm, policy, plan, ref, ref_early


class BehaviourPolicy:
    """grpo_async.py --behaviour-logp trainer: a frozen copy of the policy, sharded as it is, that holds the weights
    the engine sampled the current rollout with (one refit behind the trainer) and scores that rollout: the exact
    pi_old of the one-step off-policy ratio, computed by the trainer, so the engine is asked for no log-probs."""

    @classmethod
    def make(cls, args, model_path: str, device) -> "BehaviourPolicy | None":
        """One with --behaviour-logp trainer and --async-rollout (without, pi_old is the policy: grpo.py), else None."""
        return cls(args, model_path, device) if args.behaviour_logp == "trainer" and args.async_rollout else None

    def __init__(self, args, model_path: str, device):
        if args.lora.rank:
            raise UsageError("--behaviour-logp trainer keeps a second copy of the whole policy: not with LoRA "
                             "(--lora.rank > 0); use --behaviour-logp engine")
        lm = load_causal_lm(model_path, args.attn_impl, trainable=False)
        sp = sequence_parallel(args.sp_size, lm.config, args.attn_impl, device)
        self.model = shard(lm, args.fsdp, device,
                           root=TokenLogProbs(lm, args.logprob_impl, share_prompts=args.prompt_sharing, sp=sp))[0]

    def logprobs(self, policy, fresh: bool, seqs: tuple, temperature: float, width: int, device,
                 perf: dict) -> torch.Tensor:
        """pi_old of `seqs` (passes.sequence_logprobs' arguments), (B, width), timed as perf's old_logp (the pass it
        stands for); fresh: the policy itself sampled them (the first step, also after a resume). Then the copy takes
        the policy's weights, which sample the rollout generating now (started before this step's update), for the
        next step."""
        with timed(perf, "old_logp"):
            if fresh:  # then the copy also holds the weights of the rollout generating now: no second copy
                copy_params(policy, self.model)
            out = sequence_logprobs(self.model, *seqs, temperature, width, device)
            if not fresh:
                copy_params(policy, self.model)
        return out


def rollout_engine(args, kind: str, model_path: str, lm, d, tok, stop_ids):
    """The rollout engine (vLLM or the HF engine) for prompts of --max-prompt-tokens plus --max-new-tokens (with
    --env: plus an episode, RLArgs.rollout_max_len), the sampling settings every generation and evaluation of the
    run uses, and the environment of --env (common.env.EnvRunner; None without: one completion per prompt).
    --vllm.num-engines 0 (auto) is resolved here from the size of the policy `lm` (common.engine_process). d: the
    run's common.dist state; the engine samples from --seed."""
    check_engine_args(args.vllm)
    device, seed = d.device, args.seed
    gpu = child_gpu(args.vllm.engine_gpu, device.index or 0) if device.type == "cuda" else None  # the engines' GPU
    weights = sum(p.numel() for p in lm.parameters())  # whole-model counts (a sharded DTensor's numel is global)
    resolve_num_engines(args.vllm, kind, gpu, weights, d.world_size, d.is_main)
    if args.vllm.own_process:  # a child process of its own (common/engine_process.py)
        engine = EngineProcess(kind, model_path, args.vllm, args.rollout_max_len, seed, tok.pad_token_id, stop_ids, gpu)
    else:
        engine = make_engine(kind, model_path, args.vllm, args.rollout_max_len, seed, device, tok.pad_token_id,
                             stop_ids)
    return engine, dict(top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
                        stop_token_ids=stop_ids, ignore_eos=args.ignore_eos), make_env(args, tok)


def resume_run(args, ckpt_root: Path, state: dict, sampler):
    """--resume: load models, optimisers, LR schedules, RNG and the data position into `state` and `sampler`, exactly
    as they were (a run already past --num-steps exits 0 first: plan_run). Returns (the step to start at, the
    checkpoint or None, the adaptive KL coefficient)."""
    resume_from, kl_coef = C.resolve_resume(args.resume, ckpt_root), args.kl_coef
    plan_run(resume_from, args.num_steps, D.rank() == 0)  # --num-steps 0: an evaluation; nothing to do: exit 0
    if not resume_from:
        return 0, None, kl_coef
    extra = C.load_checkpoint(resume_from, state)
    sampler.load_state_dict(extra["sampler"])
    return extra["step"], resume_from, extra.get("kl_coef", kl_coef)


def start_tracking(args, d, run_dir: Path, start: int, resume_from, config: dict, rows: dict, plan, ref,
                   ref_early: bool, rollout_kind: str, train_size: int, dropped: int, held_out: str = ""):
    """The run's tracker (rank 0; a stand-in elsewhere) with the full config (args, `config`, the shared derived
    values), and the batch-geometry table printed on rank 0: the script's `rows`, then the shared ones. held_out:
    where the eval prompts come from (load_prompt_splits)."""
    config = to_dict(args) | {"world_size": d.world_size, "rollout_engine": rollout_kind} | config | {
        "train_prompts": train_size, "train_prompts_dropped_too_long": dropped, "held_out": held_out,
        "resumed_from": str(resume_from or "")}
    tracker = make_tracker(d.is_main, run_dir, config, args.track, args.wandb_project, args.exp_name,
                           resume_step=start if resume_from else None)
    if d.is_main:
        print(print_table("batch geometry", {"ranks": d.world_size, **rows, **geometry_rows(args, d.world_size, d.device),
                                             **plan.table(), "reference model": (
                                                 "no (kl_coef = 0)" if ref is None else
                                                 "the base (LoRA off)" if isinstance(ref, lora.BaseView) else
                                                 "replicated, scored before the gather" if ref_early else "sharded"),
                                             "rollout engine": rollout_kind + (
                                                 f", {placement(args.vllm)}" if args.vllm.own_process else ""),
                                             "train prompts (dropped too long)": f"{train_size} ({dropped})",
                                             "eval prompts": held_out if args.eval_every else "none (--eval-every 0)"}),
              flush=True)
    return tracker
