"""Reward models: a causal LM backbone with a scalar head read at the last non-pad token of a sequence (transformers'
*ForSequenceClassification with num_labels=1, so rm.py's export loads with AutoModelForSequenceClassification).

    clf = init_reward_model(model_path, tok)                  # rm.py: the LM at model_path + a new scalar head
    model = LastTokenReward(clf)                              # packed forward: one reward per sequence of a row
    scorer = RewardScorer(resolve_model(spec), policy_tok, device, budget)    # --reward-model of grpo.py / ppo.py
    r = scorer.score(prompt_ids, response_ids, prompt_texts, completions)    # (B,); on the GPU only inside
    rm = rollout_reward_model(args, tok, d)      # grpo.py / ppo.py: None without --reward-model
    rm.mix(part, prompt_texts, texts, perf)      # each step: r = rule_coef * rule + reward_model_coef * rm (normed)

The head is read where transformers reads it: at the last token of each sequence that is not the pad token (so a
checkpoint whose pad token is its EOS is read just before a trailing EOS, by rm.py, the scorer and transformers
alike). A reward model whose tokenizer or chat template differs from the policy's scores re-tokenised text: the
user turn is recovered from the policy's prompt text, the RM's chat template renders it with the decoded completion,
and the RM's tokenizer tokenises that (docs/rm.md).
"""
import math
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForSequenceClassification

from common import dist as D
from common.attention import attn_kwargs
from common.errors import UsageError
from common.models import check_attention, load_tokenizer
from common.packing import MicroBatch, pack, plan_microbatches
from common.rewards import RunningNorm
from common.tracking import timed

SENTINEL = "\x00RM-USER-TURN\x00"  # stands for the user's text when a chat template is rendered to find its frame


def _check_head(config, path: str) -> None:
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise UsageError(f"--reward-model {path}: not a sequence classifier (its config.json lists architectures "
                         f"{archs or 'none'}, not *ForSequenceClassification). Train one with rm.py (--export-hf DIR) "
                         "and pass DIR, or pass an HF reward model with a scalar head (num_labels=1)")
    if config.num_labels != 1:
        raise UsageError(f"--reward-model {path}: the score head has {config.num_labels} labels "
                         f"({list(config.id2label.values())}); a reward model has exactly one (num_labels=1, a scalar)")


def init_reward_model(path: str, tok, attn_impl: str = "sdpa") -> nn.Module:
    """A new reward model for rm.py: the causal LM (or reward model) at `path` in float32, with a scalar head
    (`score`, newly initialised unless the checkpoint has one). pad_token_id comes from `tok` if the config has
    none, so transformers reads the head where rm.py does."""
    config = AutoConfig.from_pretrained(path)
    if config.num_labels != 1:  # a causal LM config carries the default 2 labels: a scalar head has one
        config.num_labels = 1
        config.id2label, config.label2id = {0: "LABEL_0"}, {"LABEL_0": 0}
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tok.pad_token_id
    clf = AutoModelForSequenceClassification.from_pretrained(path, config=config, dtype=torch.float32,
                                                             attn_implementation=attn_impl)
    clf.config.architectures = [type(clf).__name__]
    clf.config.use_cache = False
    check_attention(clf.config, attn_impl)
    if not hasattr(clf, "score"):
        raise UsageError(f"--model {path}: {type(clf).__name__} has no `score` head; rm.py reads the scalar head of "
                         "decoder models (Llama, Qwen2, Mistral, ...) at .score")
    return clf


def load_reward_model(path: str, attn_impl: str = "sdpa") -> nn.Module:
    """A trained reward model at `path` (an HF folder or hub id; resolve_model first for a GGUF), frozen, float32.
    Clear errors for a checkpoint that is not a sequence classifier, a head with num_labels != 1, and a checkpoint
    whose weights lack the score head (transformers would initialise it at random and score noise)."""
    _check_head(AutoConfig.from_pretrained(path), path)
    clf, info = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32, output_loading_info=True,
                                                                   attn_implementation=attn_impl)
    check_attention(clf.config, attn_impl)
    if not hasattr(clf, "score"):
        raise UsageError(f"--reward-model {path}: {type(clf).__name__} has no `score` head (decoder reward models "
                         "keep their scalar head at .score)")
    head = [k for k in info.get("missing_keys", []) if k.split(".")[0] == "score"]
    if head:
        raise UsageError(f"--reward-model {path}: the checkpoint has no weights for the score head ({head} missing), "
                         "so it would score with a random head. It is a backbone, not a trained reward model: train "
                         "the head with rm.py first")
    clf.config.use_cache = False
    return clf.requires_grad_(False).eval()


def last_token_positions(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """(n,) the position in a packed row (1, T) of each sequence's last token that is not `pad_id` (transformers'
    *ForSequenceClassification rule; a sequence of pad tokens only is read at its first token, as transformers
    does). pad_id None: each sequence's last token."""
    cu = cu_seqlens.long()
    n, T = len(cu) - 1, input_ids.shape[1]
    seq = torch.repeat_interleave(torch.arange(n, device=cu.device), cu[1:] - cu[:-1])  # (T,) sequence of each token
    idx = torch.arange(T, device=cu.device)
    keep = input_ids[0] != pad_id if pad_id is not None else torch.ones_like(idx, dtype=torch.bool)
    cand = torch.where(keep, idx, cu[:-1][seq])  # a pad token stands for its sequence's start
    return cu[:-1].clone().scatter_reduce(0, seq, cand, "amax")


class LastTokenReward(nn.Module):
    """A *ForSequenceClassification model (at .lm, so export_hf(prefix="lm.") writes it as transformers names it)
    whose forward scores every sequence of a packed row: r = score(h at the last non-pad token). FSDP2 shards it as
    the root, so the head is all-gathered inside this forward."""

    def __init__(self, clf: nn.Module):
        super().__init__()
        self.lm = clf

    def forward(self, input_ids, position_ids, cu_seqlens, **attn):
        base = getattr(self.lm, self.lm.base_model_prefix)
        hidden = base(input_ids=input_ids, position_ids=position_ids, use_cache=False, **attn).last_hidden_state
        ends = last_token_positions(input_ids, cu_seqlens, self.lm.config.pad_token_id)  # (n,)
        # (n,) one reward per sequence; a new tensor, not a view (FSDP2 warns that an in-place op on a view returned
        # by a sharded module would skip its pre-backward all-gather)
        return self.lm.score(hidden[0, ends]).float()[:, 0].clone()


def sequence_rewards(model: nn.Module, mb: MicroBatch) -> torch.Tensor:
    """The rewards (len(mb.rows),) of the sequences of a packed micro-batch (none for a padding micro-batch, whose
    forward still runs so every rank makes the same FSDP2 calls)."""
    r = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, **attn_kwargs(mb))
    return r[:len(mb.rows)]


def same_tokenizer(a, b) -> bool:
    """Whether token ids of tokenizer `a` mean the same text to `b`, chat template included."""
    return a.get_vocab() == b.get_vocab() and a.chat_template == b.chat_template and \
        a.all_special_tokens == b.all_special_tokens


def user_turn(policy_tok, prompt_text: str) -> str:
    """The user's text inside a prompt the policy's chat template rendered (one user turn and the generation prompt,
    as common.data.build_prompts makes); the whole text when it does not have that frame (--no-chat-template)."""
    if not policy_tok.chat_template:
        return prompt_text
    frame = policy_tok.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                           add_generation_prompt=True)
    head, _, tail = frame.partition(SENTINEL)
    if prompt_text.startswith(head) and prompt_text.endswith(tail) and len(prompt_text) >= len(head) + len(tail):
        return prompt_text[len(head):len(prompt_text) - len(tail)]
    return prompt_text


def retokenize(policy_tok, rm_tok, prompt_text: str, completion: str) -> list[int]:
    """The RM's token ids for a (prompt the policy saw, decoded completion): the user turn and the completion
    rendered by the RM's chat template, or, for an RM without one, the policy's prompt text + the completion."""
    if rm_tok.chat_template:
        text = rm_tok.apply_chat_template([{"role": "user", "content": user_turn(policy_tok, prompt_text)},
                                           {"role": "assistant", "content": completion}], tokenize=False)
        return rm_tok(text, add_special_tokens=False)["input_ids"]
    return rm_tok(prompt_text + completion)["input_ids"]


class RewardScorer:
    """A frozen reward model that scores rollouts (--reward-model of grpo.py / ppo.py), whole on every rank: each rank
    scores its own rollout (no collective). Between calls its weights wait in CPU memory, so the step's GPU memory
    plan (docs/vllm.md) is unchanged but for the scoring itself; on CPU nothing moves."""

    def __init__(self, path: str, policy_tok, device: torch.device, budget: int, dtype: torch.dtype | None = None,
                 attn_impl: str = "sdpa"):
        self.path, self.device, self.budget, self.policy_tok = path, torch.device(device), budget, policy_tok
        self.tok = load_tokenizer(path) if (Path(path) / "tokenizer_config.json").exists() or not Path(path).exists() \
            else None
        if self.tok is None:
            raise UsageError(f"--reward-model {path}: the folder has no tokenizer (tokenizer_config.json); save the "
                             "reward model's tokenizer with it (rm.py's --export-hf does)")
        self.retokenize = not same_tokenizer(policy_tok, self.tok)
        clf = load_reward_model(path, attn_impl)
        dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        for p in clf.parameters():  # parameters only: buffers such as RoPE's inv_freq stay float32 (as in shard())
            p.data = p.data.to(dtype)
        self.model = LastTokenReward(clf)
        self.offload()

    def sequences(self, prompt_ids, response_ids, prompt_texts, completions) -> list[list[int]]:
        """The token ids the RM reads: the policy's own (same tokenizer and template) or re-tokenised text."""
        if not self.retokenize:
            return [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
        return [retokenize(self.policy_tok, self.tok, p, c) for p, c in zip(prompt_texts, completions)]

    @torch.no_grad()
    def score(self, prompt_ids, response_ids, prompt_texts, completions) -> torch.Tensor:
        """(B,) float32 on the CPU: the reward of each (prompt, response), in packed micro-batches of at most
        `budget` tokens (a longer sequence gets a micro-batch of its own). The model is on the device only inside."""
        seqs = self.sequences(prompt_ids, response_ids, prompt_texts, completions)
        out = torch.zeros(len(seqs))
        if not seqs:
            return out
        lengths = [len(s) for s in seqs]
        out = out.to(self.device)  # filled on the device, copied to the host once (no sync per micro-batch)
        self.onload()
        try:
            for rows in plan_microbatches(lengths, list(range(len(seqs))), max(self.budget, max(lengths))):
                mb = pack(seqs, [[] for _ in seqs], rows).to(self.device)
                out[rows] = sequence_rewards(self.model, mb)
        finally:
            self.offload()
        return out.cpu()

    def onload(self) -> None:
        """Weights onto the device for scoring (no-op on CPU)."""
        if self.device.type != "cpu":
            self.model.to(self.device)

    def offload(self) -> None:
        """Weights back to CPU memory and the device's cache released (no-op on CPU)."""
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()


class RolloutRewardModel:
    """--reward-model in grpo.py / ppo.py: each rank scores its own rollout with a RewardScorer (before the gather),
    optionally standardises the scores by their running mean and std over all ranks (--reward-norm), and mixes them
    into the reward: r = rule_coef * (rule reward + format shaping) + reward_model_coef * rm. Collective (every rank
    calls mix, also one with no samples). Keeps the step's sums for reward/rm_mean, reward/rm_std, reward/rule_mean."""

    def __init__(self, scorer: RewardScorer, rule_coef: float, rm_coef: float, norm: bool):
        self.scorer, self.rule_coef, self.rm_coef = scorer, rule_coef, rm_coef
        self.norm = RunningNorm() if norm else None
        self.sums = torch.zeros(4, dtype=torch.float64)  # n, sum rm, sum rm^2, sum rule (since the last metrics())

    def mix(self, part, prompt_texts: list[str], texts: list[str], perf: dict) -> None:
        """part.rewards (this rank's rule rewards, (B_rank,)) becomes the mixed reward."""
        with timed(perf, "rm_score"):
            rm = self.scorer.score(part.prompt_ids, part.response_ids, prompt_texts, texts).double()  # (B_rank,)
        rule = part.rewards.double()
        step = D.all_reduce(torch.stack([torch.tensor(float(len(rm)), dtype=torch.float64), rm.sum(),
                                         (rm ** 2).sum(), rule.sum()]))  # over all ranks
        self.sums += step
        if self.norm is not None:  # Chan's update from the batch's moments, the same on every rank
            n, mean = int(step[0]), float(step[1]) / max(1.0, float(step[0]))
            self.norm.update(n, mean, max(0.0, float(step[2]) - n * mean ** 2))
            rm = self.norm.normalize(rm)
        part.rewards = (self.rule_coef * rule + self.rm_coef * rm).float()

    def metrics(self) -> dict:
        """reward/rm_mean, reward/rm_std (the raw scores, before --reward-norm) and reward/rule_mean since the last
        call, over all ranks; then starts a new count."""
        n, s, sq, rule = self.sums.tolist()
        self.sums.zero_()
        mean = s / max(1.0, n)
        return {"reward/rm_mean": mean, "reward/rm_std": math.sqrt(max(0.0, sq / max(1.0, n) - mean ** 2)),
                "reward/rule_mean": rule / max(1.0, n)}

    def state(self) -> dict:
        """What goes into the scripts' checkpoint `state` (a RunningNorm with --reward-norm; the RM itself is
        frozen and reloaded from --reward-model)."""
        return {"reward_norm": self.norm} if self.norm is not None else {}


def rollout_reward_model(args, tok, d) -> RolloutRewardModel | None:
    """grpo.py / ppo.py `args`' --reward-model (None without one), whole on every rank of `d`, offloaded between
    steps. Rank 0 converts a GGUF first (common.rl_setup.resolve_model_once)."""
    from common.rl_setup import resolve_model_once
    if not args.reward_model:
        if args.rule_coef != 1.0 or args.reward_norm:
            raise UsageError("--rule-coef and --reward-norm weigh and normalise a --reward-model's score: pass "
                             "--reward-model, or drop them")
        return None
    if not (args.rule_coef >= 0 and args.reward_model_coef >= 0):
        raise UsageError(f"--rule-coef {args.rule_coef} and --reward-model-coef {args.reward_model_coef}: must be >= 0")
    path = resolve_model_once(args.reward_model, d.is_main)
    scorer = RewardScorer(path, tok, d.device, args.forward_token_budget, attn_impl=args.attn_impl)
    if d.is_main:
        print(f"reward model {args.reward_model}: {type(scorer.model.lm).__name__}, "
              f"{'re-tokenised text (its tokenizer differs from the policy)' if scorer.retokenize else 'policy ids'}; "
              f"r = {args.rule_coef:g} x rule + {args.reward_model_coef:g} x rm"
              f"{' (running-normalised)' if args.reward_norm else ''}", flush=True)
    return RolloutRewardModel(scorer, args.rule_coef, args.reward_model_coef, args.reward_norm)
