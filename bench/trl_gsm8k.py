"""TRL's GRPOTrainer on grpo.py's GSM8K recipe (runs/grpo_gsm8k_qwen05b.sh), for learning curves side by side.

It takes grpo.py's own flags (its Args, parsed by the same parser) and maps each one that shapes the learning onto
TRL 1.16's GRPOConfig; a flag at a value TRL cannot reproduce stops the run with one line naming it. So the recipe
itself launches it:

    SCRIPT=bench/trl_gsm8k.py MODEL=/path/qwen.gguf DATA=/path/gsm8k OUT_DIR=runs_out \\
      bash runs/grpo_gsm8k_qwen05b.sh --exp-name trl_gsm8k_qwen05b --num-steps 40 --save-every 20
    ... --exp-name trl_time --num-steps 4 --eval-every 0 --save-every 0      # timing only: no checkpoint
    python bench/trl_gsm8k.py --model M --rollout hf --device cpu ...        # CPU: TRL's transformers generate

One GPU (the recipe's torchrun --nproc_per_node=1); several are mapped (trl_geometry) but were not run. Needs TRL
1.16 (dev/queues/trl_gsm8k.txt installs its wheel; not in requirements.txt). Writes <out-dir>/<exp-name>/: config.json,
metrics.jsonl (one row per rollout step, grpo.py's step numbering and key names where they mean the same:
reward/mean, reward/correct_frac, rollout/response_len_mean, rollout/truncated_frac, train/loss, train/grad_norm,
train/lr, train/clip_frac, train/entropy, train/tis_weight_mean, rollout/logprob_gap_mean, perf/step_s,
perf/peak_mem_gib, perf/elapsed_s, and every TRL log key as trl/<key>, averaged over the rollout's optimiser steps),
and checkpoints/step_<k>/ every --save-every rollout steps: the policy alone as an HF folder (its float32 weights;
config, tokenizer and generation config copied from the model folder), which `grpo.py --model <it> --num-steps 0`
evaluates. No evaluation runs here: both trainers are measured by grpo.py's evaluator. Also summary.json, and the
last line TRL_GSM8K {...}: step times, checkpoints, torch's and the device's (nvidia-smi) memory peaks.

Made equal (the prompt ids and the stop tokens are checked at start and printed):
  - prompts: rendered by grpo.py's code (common.rl_setup.load_prompt_splits: instruction, chat template, prompts over
    --max-prompt-tokens dropped) and handed to TRL as text; TRL 1.16 tokenises a text prompt with
    `processing_class(text=prompts)` (GRPOTrainer._tokenize_prompts: default special tokens, no chat template
    applied again); check_prompt_ids runs TRL's own method on --check-prompts of them and stops on any difference.
  - prompt order: grpo.py's PromptSampler order (seeded with --seed), given to TRL with shuffle_dataset=False, so
    rollout step k samples the same 64 questions in both trainers.
  - reward: grpo.py's function (--reward-fn, common.rewards.score with --reward-timeout on the main thread, plus
    --format-coef x the format reward) on the same prompt text and the completion decoded with
    skip_special_tokens, as grpo.py does.
  - geometry: P x G sequences per generation, --num-minibatches optimiser steps of P x G / num_minibatches
    sequences each (trl_geometry), --num-epochs as num_iterations; temperature, top-p, top-k, max new tokens;
    group advantage with the unbiased group std (scale_rewards group / none); clip eps low / high; no KL (beta 0);
    truncated IS on the engine's processed log-probs, per token, capped at --tis-cap (vllm_importance_sampling_mode
    token_truncate); mask_truncated_completions off (on with --overlong mask); AdamW(lr, betas, weight decay) in
    float32 master weights, bf16 compute on the GPU, gradient-norm clip; the learning rate follows grpo.py's
    lr_lambda per rollout step (passed to TRL as the scheduler); seed.
Cannot be made equal (and why):
  1. Sampling draws: TRL seeds its colocated vLLM with the process index (0) and sends one request per sequence
     (8 copies of each prompt); grpo.py seeds every request from --seed (--vllm.seed-requests). A seed in
     generation_kwargs would give the 8 copies one seed and so 8 identical completions. Same distribution, other
     samples.
  2. Mini-batch split: grpo.py shuffles the rollout with torch.Generator(seed + step) and cuts it into
     --num-minibatches; TRL shuffles with torch's global RNG and cuts it into micro-batches of --trl-micro-batch,
     gradient_accumulation_steps of them per optimiser step. Other random halves.
  3. Token-mean normaliser: grpo.py divides a mini-batch's token-loss sum by that mini-batch's own token count;
     TRL's loss_type "dapo" (the one that normalises by tokens across the accumulated batch) divides by the whole
     generation's token count x gradient_accumulation_steps / steps_per_generation, i.e. the mean token count of
     the generation's optimiser steps. Mini-batch i's gradient is scaled by N_i / mean(N) relative to grpo.py's.
     No TRL loss type divides by exactly one optimiser step's tokens ("bnpo": per micro-batch, "grpo": per sequence,
     "dr_grpo": a constant).
  4. Advantage epsilon: TRL adds 1e-4 to the group std (fixed in its code), grpo.py --adv-eps (1e-6).
  5. Steps: TRL's global_step counts optimiser steps, so max_steps = --num-steps x optimiser steps per rollout;
     rows and checkpoints here are named by rollout step as grpo.py's are. TRL's own warm-up schedule
     (constant_with_warmup) would count optimiser steps and start at lr 0; grpo.py's lr_lambda is used instead.
  6. Log-prob numerics (pi_old for the ratio and the TIS weight, pi for the loss): grpo.py packs sequences (varlen
     attention, prompts shared) under FSDP2 with bf16 parameters and its Triton log-prob kernel; TRL pads, runs
     float32 parameters under bf16 autocast (sdpa) and its chunked fused LM head. Both recompute pi_old once before
     the first update (grpo.py because of the second mini-batch, TRL because the IS correction is on).
  7. Engine: TRL's colocated vLLM (sleep level 2 between generations by default, --trl-vllm-gpu-memory-utilization
     0.3, max_num_batched_tokens 4096 fixed by TRL, one request per sequence) against grpo.py's engine as the
     recipe sets it (resident, --vllm.sleep-level 0, 0.25 with --vllm.kv-cache-fit, prefix caching, n samples per
     request). These change time and memory, not what is learned; --vllm.* flags are grpo.py's and are ignored
     here.
  8. Stop tokens: grpo.py stops on common.models.eos_token_ids (tokenizer + config.json + generation_config.json);
     TRL's vLLM on the tokenizer's and generation_config.json's EOS. Printed at start; a difference is flagged.
  9. Checkpoints: model only at multiples of --save-every, all kept (--keep-last ignored), none at the end unless
     it is a multiple; no optimiser state, so no --resume. Evaluation flags are ignored (no evaluation here).
Also ignored, as grpo.py infrastructure with no TRL counterpart: --fsdp.*, --attn-impl, --logprob-impl,
--fused-loss, --share-prompts, --max-tokens-per-microbatch / -per-forward, --reward-workers, --engine-logprobs-every
(TRL asks the engine for log-probs whenever the IS correction is on), --log-samples-every, --track, --profile-step,
--deterministic, --max-bad-updates, --peak-flops.
"""
import json
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python bench/trl_gsm8k.py` from anywhere: common and bench importable
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # as bench/w05.py runs TRL's W05 (bench/trl_w05.py)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from bench.w05 import GpuMemPeak  # noqa: E402
from common.args import LossAgg, RLArgs, cli  # noqa: E402
from common.data import PromptSampler  # noqa: E402
from common.models import eos_token_ids, load_tokenizer, resolve_model  # noqa: E402
from common.rewards import format_reward, load_reward_fn, score  # noqa: E402
from common.rl_setup import check_geometry, load_prompt_splits  # noqa: E402
from common.run_dir import RunDirError, claim_run_dir  # noqa: E402
from common.tracking import make_tracker, print_table, to_dict  # noqa: E402


@dataclass
class Args(RLArgs):
    """grpo.py's flags, so its recipes launch this script (bench/ runs scripts, never imports them: grpo.py's own
    fields are repeated here with its defaults, and tests/test_trl_gsm8k_bench.py checks they still match), and
    TRL's own."""
    exp_name: str = "trl_gsm8k"
    num_steps: int = 10  # grpo.py's own flags and defaults from here to profile_step (grpo.py --help describes them)
    dataset: str = "arith-easy"
    max_new_tokens: int = 48
    temperature: float = 0.7
    lr: float = 2e-5
    # ---- algorithm ---------------------------------------------------------------------------------------
    group_size: int = 8
    adv_estimator: Literal["grpo", "rloo", "reinforce++", "reinforce++-baseline"] = "grpo"
    scale_by_std: bool = True
    ratio_level: Literal["token", "sequence"] = "token"
    adv_eps: float = 1e-6
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float = 0.0
    kl_coef: float = 0.0
    kl_in_reward: bool = False
    kl_target: float = 0.0
    kl_horizon: int = 10000
    kl_estimator: Literal["k1", "k2", "k3", "k1+", "k3+", "abs"] = "k3"
    entropy_coef: float = 0.0
    loss_agg: LossAgg = "token-mean"
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 1
    overlong: Literal["none", "penalty", "soft", "mask"] = "none"
    overlong_penalty: float = -0.5
    overlong_buffer: int = 0
    # ---- batch geometry ----------------------------------------------------------------------------------
    prompts_per_step: int = 0
    num_minibatches: int = 1
    num_epochs: int = 1
    max_tokens_per_microbatch: int = 0
    max_tokens_per_forward: int = 0
    # ---- profiling ---------------------------------------------------------------------------------------
    profile_step: int = -1
    # ---- TRL ---------------------------------------------------------------------------------------------
    trl_micro_batch: int = 32
    """per_device_train_batch_size: sequences per forward/backward (bench/trl_w05.py's W05 setting)"""
    trl_vllm_gpu_memory_utilization: float = 0.3
    """vllm_gpu_memory_utilization of TRL's colocated engine (TRL's default, W05's setting)"""
    trl_vllm_sleep: bool = True
    """vllm_enable_sleep_mode: the engine frees its weights and KV cache between generations (W05's setting)"""
    trl_gradient_checkpointing: bool = False
    """gradient_checkpointing (TRL's default is on; W05 ran without)"""
    check_prompts: int = 200
    """prompts whose token ids are compared between grpo.py's rendering and TRL's tokenisation at start"""

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}


# ---- pure functions (tests/test_trl_gsm8k_bench.py) ----------------------------------------------------------
def trl_geometry(prompts_per_step: int, group_size: int, num_minibatches: int, num_epochs: int, micro_batch: int,
                 world_size: int) -> dict:
    """GRPOConfig's batch fields for P x G sequences per generation learned in `num_minibatches` optimiser steps of
    P x G / num_minibatches sequences each (per epoch): micro-batches of `micro_batch` per device,
    gradient_accumulation_steps of them per optimiser step, steps_per_generation micro-batches per generation."""
    seqs = prompts_per_step * group_size
    if seqs % num_minibatches:
        raise ValueError(f"--num-minibatches {num_minibatches} must divide the {seqs} sequences per step")
    per_step = seqs // num_minibatches
    if per_step % (micro_batch * world_size):
        raise ValueError(f"--trl-micro-batch {micro_batch} x {world_size} GPU(s) must divide the {per_step} sequences "
                         f"of one optimiser step; pick a divisor of {per_step // world_size}")
    accum = per_step // (micro_batch * world_size)
    return {"num_generations": group_size, "per_device_train_batch_size": micro_batch,
            "gradient_accumulation_steps": accum, "steps_per_generation": num_minibatches * accum,
            "num_iterations": num_epochs}


def trl_batches(cfg: dict, world_size: int) -> dict:
    """What TRL 1.16 makes of those fields (GRPOConfig.__post_init__, GRPOTrainer._prepare_inputs): sequences per
    generation, optimiser steps per generation and sequences per optimiser step."""
    per_micro = cfg["per_device_train_batch_size"] * world_size
    micro_steps = cfg["steps_per_generation"] * cfg["num_iterations"]  # training_step calls per generation
    return {"sequences_per_generation": per_micro * cfg["steps_per_generation"],
            "optimizer_steps_per_generation": micro_steps / cfg["gradient_accumulation_steps"],
            "sequences_per_optimizer_step": per_micro * cfg["gradient_accumulation_steps"]}


def unsupported(args: Args) -> list[str]:
    """grpo.py flags at values this mapping cannot reproduce in TRL, one message each (empty: all mapped)."""
    bad = [(args.adv_estimator != "grpo", f"--adv-estimator {args.adv_estimator}: only grpo"),
           (args.ratio_level != "token", f"--ratio-level {args.ratio_level}: only token"),
           (args.dual_clip_c != 0, "--dual-clip-c: TRL has no dual clip (its delta is another bound)"),
           (args.kl_coef != 0 or args.kl_in_reward or args.kl_target,
            "--kl-coef / --kl-in-reward / --kl-target: only kl_coef 0 is mapped (TRL's KL term differs)"),
           (args.entropy_coef != 0, "--entropy-coef: only 0 (TRL's bonus is a per-micro-batch mean)"),
           (args.loss_agg not in LOSS_TYPES, f"--loss-agg {args.loss_agg}: one of {sorted(LOSS_TYPES)}"),
           (args.dynamic_sampling, "--dynamic-sampling: TRL has none"),
           (args.overlong not in ("none", "mask"), f"--overlong {args.overlong}: none or mask"),
           (args.reward_model is not None, "--reward-model: not mapped"),
           (bool(args.env), "--env: not mapped"),
           (args.lora.rank != 0, "--lora.rank: not mapped"),
           (bool(args.resume), "--resume: the checkpoints here hold no optimiser state"),
           (bool(args.export_hf), "--export-hf: use --save-every (checkpoints/step_<k> are HF folders)"),
           (args.ignore_eos and args.rollout == "hf", "--ignore-eos: with vLLM only")]
    return [msg for cond, msg in bad if cond]


def grpo_config_kwargs(args: Args, world_size: int, use_vllm: bool, cuda: bool, output_dir: str) -> dict:
    """The GRPOConfig of `args` (grpo.py's flags) on `world_size` GPUs."""
    geo = trl_geometry(args.prompts_per_step, args.group_size, args.num_minibatches, args.num_epochs,
                       args.trl_micro_batch, world_size)
    tis = args.tis_cap > 0
    return geo | {
        "output_dir": output_dir, "seed": args.seed, "max_steps": args.num_steps * args.optimizer_steps_per_rollout,
        "logging_steps": 1, "report_to": "none", "save_strategy": "no", "disable_tqdm": True, "shuffle_dataset": False,
        "bf16": cuda, "use_cpu": not cuda, "gradient_checkpointing": args.trl_gradient_checkpointing,
        "learning_rate": args.lr, "adam_beta1": args.adam_betas[0], "adam_beta2": args.adam_betas[1],
        "weight_decay": args.weight_decay, "max_grad_norm": args.max_grad_norm,
        "beta": 0.0, "loss_type": LOSS_TYPES[args.loss_agg], "scale_rewards": "group" if args.scale_by_std else "none",
        "epsilon": args.clip_eps_low, "epsilon_high": args.clip_eps_high, "importance_sampling_level": "token",
        "mask_truncated_completions": args.overlong == "mask",
        "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
        "max_completion_length": args.max_new_tokens,
        "generation_kwargs": {"ignore_eos": True} if args.ignore_eos else None,
        "use_vllm": use_vllm, "vllm_mode": "colocate", "vllm_enable_sleep_mode": args.trl_vllm_sleep,
        "vllm_gpu_memory_utilization": args.trl_vllm_gpu_memory_utilization,
        "vllm_max_model_length": args.rollout_max_len,
        "vllm_importance_sampling_correction": tis, "vllm_importance_sampling_mode": "token_truncate",
        "vllm_importance_sampling_clip_max": args.tis_cap if tis else 3.0,
    }


# Same as grpo.py:lr_lambda
def lr_lambda(step: int, warmup_steps: int, num_steps: int, schedule: str) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, num_steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def lr_per_optimizer_step(k: int, warmup_steps: int, num_steps: int, schedule: str):
    """The LambdaLR factor of optimiser step s when each rollout step takes `k` of them: grpo.py's lr_lambda of
    rollout step s // k (grpo.py steps its scheduler once per rollout; TRL steps it after every optimiser step)."""
    return lambda s: lr_lambda(s // k, warmup_steps, num_steps, schedule)


def ordered_prompts(train: list, prompts_per_step: int, seed: int, num_steps: int) -> list:
    """The prompts grpo.py's sampler draws in `num_steps` rollout steps, in its order (the whole batch, as one rank
    sees it with world size 1): TRL reads them in this order (shuffle_dataset False), prompts_per_step a generation."""
    sampler = PromptSampler(train, prompts_per_step, seed, rank=0, world_size=1)
    return [e for _ in range(num_steps) for e in sampler.next_batch()]


def trl_tokenize(tok, texts: list[str], trainer_cls=None) -> list[list[int]]:
    """Token ids TRL gives text prompts: GRPOTrainer._tokenize_prompts itself when `trainer_cls` is given (it reads
    only self.processing_class for text prompts), else its line for them in TRL 1.16:
    `self.processing_class(text=prompts)["input_ids"]`."""
    if trainer_cls is not None:
        return [list(x) for x in trainer_cls._tokenize_prompts(SimpleNamespace(processing_class=tok), texts)[0]]
    return [list(x) for x in tok(text=texts)["input_ids"]]


def check_prompt_ids(tok, examples: list, n: int, trainer_cls=None) -> str:
    """Compare grpo.py's prompt ids with TRL's tokenisation of the same text on `n` prompts spread over `examples`;
    a ValueError showing the first difference, else the line to print."""
    sample = examples[::max(1, len(examples) // max(1, n))][:n]
    got = trl_tokenize(tok, [e.prompt_text for e in sample], trainer_cls)
    for e, ids in zip(sample, got):
        if ids != e.prompt_ids:
            at = next((i for i, (a, b) in enumerate(zip(ids, e.prompt_ids)) if a != b),
                      min(len(ids), len(e.prompt_ids)))
            raise ValueError(f"TRL tokenises a prompt differently from grpo.py (first difference at token {at}: TRL "
                             f"{ids[max(0, at - 2):at + 3]}, grpo.py {e.prompt_ids[max(0, at - 2):at + 3]}; lengths "
                             f"{len(ids)} / {len(e.prompt_ids)}): {e.prompt_text[:120]!r}")
    return (f"prompt ids: TRL's tokenisation of {len(sample)} prompts equals grpo.py's "
            f"({sum(len(e.prompt_ids) for e in sample)} tokens)")


def trl_reward(reward_fn, timeout_s: float, format_coef: float, name: str):
    """grpo.py's reward as a TRL reward function: score() on (prompt text, decoded completion, answer), plus
    format_coef x the format reward (common.rollout.score_rollout). Logs correct_frac, reward_errors and
    reward_timeouts through TRL's log_metric."""
    def reward(prompts, completions, answer, log_metric=None, **kwargs) -> list[float]:
        res = score(reward_fn, prompts, completions, answer, timeout_s=timeout_s)
        out = torch.tensor(res.rewards, dtype=torch.float32)  # as grpo.py holds them
        if log_metric is not None:
            log_metric("correct_frac", float((out > 0).float().mean()))
            log_metric("reward_errors", float(res.n_errors))
            log_metric("reward_timeouts", float(res.n_timeouts))
        if res.first_error:
            print(f"{res.n_errors} reward errors, {res.n_timeouts} timeouts; first: {res.first_error}", flush=True)
        if format_coef:
            out += format_coef * torch.tensor([format_reward(p, c, a) for p, c, a in zip(prompts, completions, answer)])
        return out.tolist()
    reward.__name__ = name
    return reward


# grpo.py's metric keys for TRL's log keys that measure the same thing
SAME_AS = {"reward": "reward/mean", "reward_std": "reward/std", "correct_frac": "reward/correct_frac",
           "reward_errors": "reward/errors", "reward_timeouts": "reward/timeouts",
           "completions/mean_length": "rollout/response_len_mean", "completions/max_length": "rollout/response_len_max",
           "completions/clipped_ratio": "rollout/truncated_frac", "loss": "train/loss", "grad_norm": "train/grad_norm",
           "learning_rate": "train/lr", "entropy": "train/entropy", "clip_ratio/region_mean": "train/clip_frac",
           "sampling/importance_sampling_ratio/mean": "train/tis_weight_mean",
           "sampling/sampling_logp_difference/mean": "rollout/logprob_gap_mean",
           "sampling/sampling_logp_difference/max": "rollout/logprob_gap_max"}


def rollout_row(logs: list[dict]) -> dict:
    """One metrics row from the TRL logs of one rollout's optimiser steps: each numeric key averaged over the logs
    that have it (the reward is logged once a generation), as trl/<key> and under grpo.py's name where SAME_AS
    has one."""
    keys = {k for log in logs for k, v in log.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    row = {}
    for k in sorted(keys):
        vals = [float(log[k]) for log in logs if isinstance(log.get(k), (int, float))]
        row[f"trl/{k}"] = statistics.fmean(vals)
        if k in SAME_AS:
            row[SAME_AS[k]] = vals[0] if k == "learning_rate" else row[f"trl/{k}"]
    return row


def save_hf(model, src: Path, dest: Path) -> None:
    """The policy as an HF folder at `dest`, written atomically: its weights (float32, as trained), and every other
    file of the model folder `src` copied unchanged (config.json, tokenizer, chat template, generation config: the
    Trainer aligns the in-memory configs' special-token ids with the tokenizer, which must not reach the evaluator).
    An existing `dest` is refused (ValueError)."""
    if dest.exists():
        raise ValueError(f"{dest} exists: pick another --exp-name / --out-dir, or --overwrite the run")
    tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith(("model", "pytorch_model")):
            shutil.copy2(f, tmp / f.name)
    tmp.rename(dest)


class RolloutLog(TrainerCallback):
    """Per rollout step (`k` optimiser steps): the wall time since the previous one ended (checkpoint writes
    excluded), torch's peak memory, TRL's logs merged (rollout_row) into one metrics row; then the checkpoint."""

    def __init__(self, k: int, tracker, save_every: int, src: Path, ckpt_root: Path):
        self.k, self.tracker, self.save_every, self.src, self.ckpt_root = k, tracker, save_every, src, ckpt_root
        self.logs, self.steps, self.peaks, self.checkpoints, self.trainer, self.done = [], [], [], [], None, 0

    def _mark(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.t = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        self._mark()
        self.t0 = self.t

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.k == 0:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                self.peaks.append(torch.cuda.max_memory_allocated() / 2**30)
            self.steps.append(time.perf_counter() - self.t)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.global_step <= self.done:  # the end-of-training summary is logged at the last step again
            return
        self.logs.append(dict(logs or {}))
        if state.global_step % self.k:
            return
        self.done, step = state.global_step, state.global_step // self.k - 1  # grpo.py's numbering, from 0
        row = rollout_row(self.logs) | {"perf/step_s": self.steps[-1], "perf/elapsed_s": time.perf_counter() - self.t0}
        row |= {"perf/peak_mem_gib": self.peaks[-1]} if self.peaks else {}
        self.logs = []
        if state.is_world_process_zero:
            self.tracker.log(row, step)
            print(f"step {step:4d} | reward {row.get('reward/mean', float('nan')):.3f} | len "
                  f"{row.get('rollout/response_len_mean', float('nan')):6.1f} | {row['perf/step_s']:.1f} s/step"
                  + (f" | peak {self.peaks[-1]:.1f} GiB" if self.peaks else ""), flush=True)
        if self.save_every and (step + 1) % self.save_every == 0:
            if state.is_world_process_zero:
                dest = self.ckpt_root / f"step_{step + 1}"
                t = time.perf_counter()
                save_hf(self.trainer.accelerator.unwrap_model(self.trainer.model), self.src, dest)
                self.checkpoints.append(str(dest))
                print(f"checkpoint: {dest} ({time.perf_counter() - t:.1f} s)", flush=True)
            self.trainer.accelerator.wait_for_everyone()
        self._mark()


def main(args: Args) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.prompts_per_step == 0:  # as grpo.py: 2 per rank
        args.prompts_per_step = 2 * world
    problems = unsupported(args) + (["--num-steps: at least 1"] if args.num_steps < 1 else [])
    if problems:
        raise SystemExit("bench/trl_gsm8k.py: not reproducible in TRL: " + "; ".join(problems))
    try:
        check_geometry(args, world, (("dynamic_sampling_max_rounds", 1),))  # grpo.py's own checks of its flags
        geo = trl_geometry(args.prompts_per_step, args.group_size, args.num_minibatches, args.num_epochs,
                           args.trl_micro_batch, world)
    except ValueError as e:
        raise SystemExit(f"bench/trl_gsm8k.py: {e}") from None
    cuda = args.device != "cpu" and torch.cuda.is_available()
    use_vllm = args.rollout == "vllm" or (args.rollout == "auto" and cuda)

    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import create_model_from_path

    model_path = resolve_model(args.model)  # a GGUF: grpo.py's conversion (cached), the folder grpo.py trains
    tok = load_tokenizer(model_path)  # grpo.py's tokenizer set-up, used both to render and by TRL
    train, dropped, _, _ = load_prompt_splits(args, tok, 0, 1)
    rows = ordered_prompts(train, args.prompts_per_step, args.seed, args.num_steps)
    run_dir = Path(args.out_dir) / args.exp_name
    try:
        print(check_prompt_ids(tok, rows, args.check_prompts, GRPOTrainer), flush=True)
        cfg = GRPOConfig(**grpo_config_kwargs(args, world, use_vllm, cuda, str(run_dir / "trl")))  # starts the ranks
        claim_run_dir(run_dir, "", args.overwrite)  # one run at a time; an earlier run's files only with --overwrite
    except (ValueError, RunDirError) as e:
        raise SystemExit(f"bench/trl_gsm8k.py: {e}") from None
    is_main = cfg.process_index == 0
    k = args.optimizer_steps_per_rollout
    derived = {"train prompts (dropped too long)": f"{len(train)} ({dropped})",
               "prompts / rollout step": args.prompts_per_step, **geo, **trl_batches(geo, world),
               "max_steps (optimiser steps)": cfg.max_steps,
               "loss_type": cfg.loss_type, "rollout": "vLLM colocate" if use_vllm else "transformers generate"}
    tracker = make_tracker(is_main, run_dir, to_dict(args) | {"model_path": model_path, "trl_config": cfg.to_dict(),
                                                              "derived": derived}, False, "", args.exp_name)
    if is_main:
        print(print_table("TRL GRPOTrainer on grpo.py's flags", derived), flush=True)

    from datasets import Dataset
    dataset = Dataset.from_dict({"prompt": [e.prompt_text for e in rows], "answer": [e.answer for e in rows]})
    model = create_model_from_path(model_path)  # TRL's own loading of a model path: float32
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=args.adam_betas, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_per_optimizer_step(k, args.warmup_steps, args.num_steps, args.lr_schedule))
    log = RolloutLog(k, tracker, args.save_every, Path(model_path), run_dir / "checkpoints")
    reward = trl_reward(load_reward_fn(args.reward_fn), args.reward_timeout, args.format_coef, args.reward_fn)
    t = time.perf_counter()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=dataset, processing_class=tok,
                          callbacks=[log], optimizers=(optimizer, scheduler))
    log.trainer = trainer
    setup_s = time.perf_counter() - t
    grpo_stop, trl_stop = eos_token_ids(tok, model_path), sorted(trainer.eos_token_ids)
    if is_main:
        print(f"stop tokens: grpo.py {grpo_stop}, TRL {trl_stop} "
              f"({'equal' if grpo_stop == trl_stop else 'DIFFERENT: completions end differently'})", flush=True)
    with GpuMemPeak() as device_mem:
        trainer.train()
    if is_main:
        warm = log.steps[1:] or log.steps
        summary = {"steps": [round(s, 2) for s in log.steps],
                   "median_warm_s": statistics.median(warm) if warm else None, "train_s": sum(log.steps),
                   "setup_s": setup_s, "checkpoints": log.checkpoints,
                   "peak_mem_gib": max(log.peaks, default=None) if cuda else None,
                   "device_peak_gib": max(device_mem.peak.values()) if device_mem.peak else None,
                   "stop_tokens_equal": grpo_stop == trl_stop, "run_dir": str(run_dir)}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        tracker.finish()
        print("TRL_GSM8K " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main(cli(Args, __doc__))
