"""Rollouts: the transformers engine (CPU, debugging; the vLLM engine is common/vllm_engine.py), what an engine
returns (Rollout), sampling and scoring on one rank, the scored batch that crosses ranks (RolloutBatch, gathered by
gather_rollout) and the engine refit at the end of a step (sync_engine). Every engine has generate / sleep / wake /
load_weights (docs/architecture.md)."""
from dataclasses import dataclass, fields
from typing import Iterable

import torch
from transformers import AutoModelForCausalLM

from common import dist as D
from common.lora import refit_params
from common.progress import token_streamer
from common.rewards import ScoreResult, _short, format_reward, score
from common.tracking import timed


@dataclass
class Rollout:
    prompt_ids: list[list[int]]           # (B,) each prompt repeated n times, prompt-major
    response_ids: list[list[int]]         # (B,) generated tokens, the stop token included
    logprobs: list[list[float]] | None    # (B,) sampling log-probs per response token; None if unknown
    finish_reasons: list[str]             # (B,) "stop" | "length"
    episodes: "Episodes | None" = None    # multi-turn rollouts (common/env.py); None for one prompt, one completion


@dataclass
class Episodes:
    """Per-episode facts of a multi-turn rollout (common.env.run_episodes), aligned with Rollout's rows."""
    loss_mask: list[list[int]]            # (B,) per response token: 1 the model's, 0 the environment's
    turns: list[int]                      # (B,) model turns
    tool_calls: list[int]                 # (B,) observations flagged tool_call
    tool_errors: list[int]                # (B,) ... and tool_error (malformed call, failed evaluation)
    env_reward: list[float | None]        # (B,) the last reward the environment gave (None: --reward-fn scores)
    turn_rewards: list[list[float | None]]  # (B,) the reward so far after each turn (None: not given)
    errors: list[str | None]              # (B,) why the environment failed (raised, bad return), or None
    timed_out: list[bool]                 # (B,) ... by running past --reward-timeout
    max_turns: int
    name: str                             # --env, for messages


@dataclass
class RolloutBatch:
    """One step's scored rollout: this rank's (built after scoring), or every rank's (from gather_rollout), in rank
    order, prompt-major (a prompt's n samples are adjacent and never span ranks)."""
    prompt_ids: list[list[int]]          # (B,) each prompt repeated n times
    response_ids: list[list[int]]        # (B,) generated tokens, the stop token included
    rewards: torch.Tensor                # (B,) float32, the task reward plus any shaping
    correct: torch.Tensor                # (B,) bool, the task reward alone > 0
    truncated: torch.Tensor              # (B,) bool, stopped by --max-new-tokens
    engine_logp: torch.Tensor            # (B, T) the engine's sampling log-probs, 0 where it gave none
    engine_mask: torch.Tensor            # (B, T) bool, where it gave one (a log-prob of exactly 0 is one)
    ref_logp: torch.Tensor | None        # (B, T) a replicated reference's, scored before the gather; else None
    n_errors: int                        # reward calls that raised (summed over ranks by the gather)
    n_timeouts: int                      # reward calls that timed out (summed)
    generate_s: float                    # seconds this rank generated (the gather keeps the slowest rank's)
    # multi-turn rollouts (--env, common/env.py; None without): the response is the whole episode after the prompt
    loss_mask: torch.Tensor | None = None    # (B, T) float, 1 on the model's tokens, 0 on the environment's
    turns: torch.Tensor | None = None        # (B,) model turns
    tool_calls: torch.Tensor | None = None   # (B,) tool calls
    tool_errors: torch.Tensor | None = None  # (B,) failed tool calls (error observations to the model)
    turn_rewards: torch.Tensor | None = None  # (B, max_turns) reward after each turn, the last carried forward
    n_env_errors: int = 0                    # episodes whose environment raised or timed out (also in n_errors)

    @property
    def lengths(self) -> list[int]:
        """Tokens of each sequence, prompt + response: what packing and rank balancing weigh."""
        return [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)]

    @property
    def response_len(self) -> torch.Tensor:
        return torch.tensor([len(r) for r in self.response_ids])  # (B,)

    def response_mask(self, width: int) -> torch.Tensor:
        """(B, T) float, 1 on each response's tokens (responses start at column 0) that the model wrote: in a
        multi-turn episode the environment's tokens are context, not actions, so the loss, KL and entropy skip them."""
        mask = (torch.arange(width)[None] < self.response_len[:, None]).float()
        return mask if self.loss_mask is None else mask * self.loss_mask[:, :width]


def gather_rollout(part: RolloutBatch) -> RolloutBatch:
    """Every rank's RolloutBatch, concatenated in rank order, on every rank (token ids and scalars are small)."""
    return merge_rollouts(D.all_gather_objects(part))


def merge_rollouts(parts: list[RolloutBatch]) -> RolloutBatch:
    """RolloutBatches concatenated in order (ranks, or generation rounds); generate_s is the largest."""
    merged = {}
    for f in fields(RolloutBatch):
        values = [getattr(p, f.name) for p in parts]
        if f.name == "generate_s":
            merged[f.name] = max(values)  # the rank every other one waits for
        elif isinstance(values[0], list):
            merged[f.name] = [x for v in values for x in v]
        elif isinstance(values[0], torch.Tensor):
            merged[f.name] = torch.cat(values)
        elif values[0] is None:
            merged[f.name] = None
        else:
            merged[f.name] = sum(values)
    return RolloutBatch(**merged)


def padded(rows: list[list[float]], width: int, dtype=torch.float32) -> torch.Tensor:
    """Ragged per-token lists -> (B, width), zero after each row's end."""
    out = torch.zeros(len(rows), width, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r[:width], dtype=dtype)
    return out


def generate(engine, examples, n: int, temperature: float, seed: int, sampling: dict, perf: dict,
             logprobs: bool = False, env=None) -> Rollout:
    """Sample n completions for each of this rank's `examples` (seconds into perf["generate_s"]), with the sampled
    tokens' log-probs if `logprobs`. sampling: the engine's other generate keywords (top_p, top_k, max_new_tokens,
    stop_token_ids, ignore_eos). env: a common.env.EnvRunner (--env): n multi-turn episodes per example instead."""
    with timed(perf, "generate"):
        if env is not None:
            from common.env import run_episodes  # common.env builds on this module
            rollout = run_episodes(engine, env, examples, n, temperature, seed, sampling, logprobs)
        else:
            rollout = engine.generate([e.prompt_ids for e in examples], n=n, temperature=temperature, seed=seed,
                                      logprobs=logprobs, **sampling)
    if "generate_cpu" in engine.timings:  # vLLM: CPU seconds of its host loop (close to generate_s: host-bound)
        perf["generate_cpu_s"] = engine.timings["generate_cpu"]
    return rollout


def score_rollout(rollout: Rollout, examples, reward_fn, tok, reward_timeout: float, format_coef: float,
                  width: int, perf: dict):
    """Score this rank's rollout (seconds into perf["score_s"]): the task reward (common.rewards.score), plus
    format_coef x the format reward. Returns this rank's RolloutBatch and its texts, prompts and answers (for the
    samples table); reward errors and timeouts are counted in it and the first error is printed."""
    n = len(rollout.response_ids) // max(1, len(examples))
    with timed(perf, "score"):
        texts = tok.batch_decode(rollout.response_ids, skip_special_tokens=True) if examples else []  # [] -> ['']
        prompts = [e.prompt_text for e in examples for _ in range(n)]
        answers = [e.answer for e in examples for _ in range(n)]
        ep = rollout.episodes
        if ep is None:
            res = score(reward_fn, prompts, texts, answers, timeout_s=reward_timeout)
        else:  # the environment's reward where it gave one, else --reward-fn on the episode's text
            res = score_episodes(ep, reward_fn, prompts, texts, answers, reward_timeout)
    if res.first_error:
        print(f"[rank {torch.distributed.get_rank()}] {res.n_errors} reward errors, {res.n_timeouts} timeouts; first: {res.first_error}",
              flush=True)
    rewards = torch.tensor(res.rewards, dtype=torch.float32)  # (B_rank,)
    correct = rewards > 0  # (B_rank,) the task reward alone, before shaping
    if format_coef:
        rewards += format_coef * torch.tensor([format_reward(p, t, a) for p, t, a in zip(prompts, texts, answers)])
    part = RolloutBatch(rollout.prompt_ids, rollout.response_ids, rewards, correct,
                        torch.tensor([f == "length" for f in rollout.finish_reasons]),  # truncated
                        padded(engine_rows := rollout.logprobs or [[]] * len(texts), width),
                        padded([[1.0] * len(lp) for lp in engine_rows], width).bool(), None, res.n_errors,
                        res.n_timeouts, perf.get("generate_s", 0.0))
    if ep is not None:
        add_episodes(part, ep, rewards, width)
    return part, texts, prompts, answers


def score_episodes(ep: Episodes, reward_fn, prompts, texts, answers, reward_timeout: float) -> ScoreResult:
    """Episode rewards: the environment's last reward where it gave one, 0 where it failed (counted with the reward
    errors and timeouts, the first printed), else reward_fn on the prompt and the episode's text (tool results
    included). As for reward functions, a batch in which every episode failed stops the run."""
    todo = [i for i, (r, e) in enumerate(zip(ep.env_reward, ep.errors)) if r is None and e is None]
    res = score(reward_fn, *([x[i] for i in todo] for x in (prompts, texts, answers)), timeout_s=reward_timeout)
    rewards = [0.0 if r is None else r for r in ep.env_reward]
    for i, r in zip(todo, res.rewards):
        rewards[i] = r
    failed = [i for i, e in enumerate(ep.errors) if e is not None]
    n_timeouts = sum(ep.timed_out)
    first = res.first_error
    if failed:
        i = failed[0]
        first = (f"environment {ep.name} failed on episode {i}: {ep.errors[i]}\n  prompt={_short(prompts[i])}\n"
                 f"  episode={_short(texts[i])}\n  answer={_short(answers[i])}")
        if len(failed) == len(rewards):
            raise RuntimeError(f"the environment failed in every one of the {len(rewards)} episodes; first: {first}")
    return ScoreResult(rewards, res.n_errors + len(failed) - n_timeouts, res.n_timeouts + n_timeouts, first)


def add_episodes(part: RolloutBatch, ep: Episodes, rewards: torch.Tensor, width: int) -> None:
    """The multi-turn fields of a RolloutBatch: the loss mask, the counts, the reward after each turn (the final
    reward, task and shaping, at the last turn and carried forward; None before it is 0)."""
    part.loss_mask = padded(ep.loss_mask, width)
    part.engine_mask &= part.loss_mask.bool()  # the engine sampled the model's tokens only
    part.turns, part.tool_calls, part.tool_errors = (torch.tensor(x) for x in (ep.turns, ep.tool_calls, ep.tool_errors))
    rows = [[0.0 if r is None else r for r in tr[:max(0, t - 1)]] + [float(R)] for tr, t, R in
            zip(ep.turn_rewards, ep.turns, rewards)]
    part.turn_rewards = torch.tensor([r + r[-1:] * (ep.max_turns - len(r)) for r in rows]).reshape(-1, ep.max_turns)
    part.n_env_errors = sum(e is not None for e in ep.errors)


def make_engine(kind: str, model_path: str, vllm_args, max_model_len: int, seed: int, device, pad_token_id: int,
                stop_ids: list[int]):
    """The rollout engine ("vllm" or "hf"), asleep: training owns the memory until sync_engine wakes it."""
    if kind == "vllm":
        from common.vllm_engine import VLLMEngine
        engine = VLLMEngine(model_path, vllm_args, max_model_len, seed=seed)
    else:
        engine = HFEngine(model_path, device, pad_token_id=pad_token_id, eos_token_ids=stop_ids)
    engine.sleep()
    return engine


def sync_engine(engine, policy, trained: bool, gather_all: bool, perf: dict) -> None:
    """The end of a step: wake the engine's weights, refit them from the FSDP2 shards if the policy trained since
    the last refit (or a level-2 sleep discarded them), then wake the KV cache for the next generation. A
    collective when it refits (every rank streams the full tensors)."""
    with timed(perf, "wake_weights"):
        engine.wake(["weights"])
    if trained or engine.weights_discarded:
        with timed(perf, "refit"):
            engine.load_weights(refit_params(policy, "lm.", gather_all))  # LoRA: merged W + (alpha/r) B A
    with timed(perf, "wake_kv"):
        engine.wake(["kv_cache"])


def rollout_metrics(batch: RolloutBatch) -> dict:
    """reward/* and rollout/* metrics of the gathered batch (docs/grpo.md, docs/ppo.md)."""
    resp_len = batch.response_len
    return {"reward/mean": batch.rewards.mean(), "reward/std": batch.rewards.std() if len(resp_len) > 1 else 0.0,
            "reward/correct_frac": batch.correct.float().mean(),
            "reward/errors": batch.n_errors, "reward/timeouts": batch.n_timeouts,
            "rollout/response_len_mean": resp_len.float().mean(), "rollout/response_len_max": resp_len.max(),
            "rollout/truncated_frac": batch.truncated.float().mean()} | multi_turn_metrics(batch)


def multi_turn_metrics(batch: RolloutBatch) -> dict:
    """rollout/* of multi-turn episodes (docs/multiturn.md); {} for single-turn rollouts."""
    if batch.turns is None:
        return {}
    return {"rollout/turns_mean": batch.turns.float().mean(),
            "rollout/tool_calls_mean": batch.tool_calls.float().mean(),
            "rollout/tool_errors": batch.tool_errors.sum(), "rollout/env_errors": batch.n_env_errors,
            "rollout/episode_len_mean": batch.response_len.float().mean(),
            "rollout/model_tokens_mean": batch.loss_mask.sum(1).mean()} | {
        f"reward/turn{t + 1}": batch.turn_rewards[:, t].mean() for t in range(batch.turn_rewards.shape[1])}


def sample_rows(prompts: list[str], texts: list[str], answers: list[str], rewards: torch.Tensor) -> list[dict]:
    """The first few (prompt, completion, answer, reward) of this rank, for the samples table."""
    return [{"prompt": prompts[i], "completion": texts[i], "answer": answers[i], "reward": float(rewards[i])}
            for i in range(min(4, len(texts)))]


def step_line(step: int, metrics: dict) -> str:
    """The line printed after each step."""
    return (f"step {step:4d} | reward {float(metrics['reward/mean']):.3f}"
            f" | correct {float(metrics['reward/correct_frac']):.3f}"
            f" | len {float(metrics['rollout/response_len_mean']):6.1f} | loss {float(metrics['train/loss']):+.4f}"
            f" | {metrics['perf/step_s']:.1f} s/step")


def log_step(tracker, progress, step: int, metrics: dict, samples_every: int, samples: tuple,
             hint: str | None = None) -> None:
    """A step's metrics row; every `samples_every` steps (0: never) a few of this rank's samples, from `samples` =
    (prompts, completions, answers, rewards); then the progress line (or bar) of the step, after `hint` if any."""
    if hint:
        print(hint, flush=True)
    tracker.log({k: float(v) for k, v in metrics.items()}, step)
    if samples_every and step % samples_every == 0:
        tracker.log_samples(sample_rows(*samples), step)
    progress.update(step_line(step, metrics), reward=metrics["reward/mean"], s_per_step=metrics["perf/step_s"])


class HFEngine:
    """transformers `generate` on its own copy of the weights, refit from the trainer like the vLLM engine, so
    the CPU path exercises the same choreography (wake, load_weights, generate, sleep)."""
    weights_discarded = False  # sleep keeps the weights (VLLMEngine: True after a level-2 sleep, until a refit)
    asleep = False  # between sleep() and wake()

    def __init__(self, model_path: str, device: torch.device, dtype: torch.dtype = torch.float32,
                 pad_token_id: int = 0, eos_token_ids: list[int] | None = None):
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
        self.device, self.pad, self.eos = device, pad_token_id, list(eos_token_ids or [])
        self.params = dict(self.model.named_parameters())
        self.timings: dict[str, float] = {}

    def resident_hint(self, perf: dict) -> None:
        """VLLMEngine's hint when it sleeps although it would fit beside training; this engine never sleeps."""
        return None

    @torch.no_grad()
    def generate(self, prompt_ids, n, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=64, seed=0,
                 stop_token_ids=None, ignore_eos=False, logprobs=True, first_request=0) -> Rollout:
        if not prompt_ids:  # a rank with no prompts (e.g. fewer --eval-size prompts than ranks)
            return Rollout([], [], [] if logprobs else None, [])
        stops = list(stop_token_ids or self.eos)
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompt_ids):  # left padding, as decoder-only generation wants
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        greedy = temperature == 0
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            # a share of a batch (first_request > 0, --vllm.num-engines) draws from a stream of its own
            torch.manual_seed(seed if not first_request else hash((seed, first_request)) % 2**63)
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), do_sample=not greedy,
                temperature=None if greedy else temperature, top_p=None if greedy else top_p,
                top_k=None if greedy or top_k <= 0 else top_k, max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens if ignore_eos else None, num_return_sequences=n,
                eos_token_id=stops or None, pad_token_id=self.pad, output_scores=logprobs,
                return_dict_in_generate=True, streamer=token_streamer(max_new_tokens))  # rank 0's bar: token i/N
        new = out.sequences[:, width:].cpu()  # (B, T_new)
        # scores are the processed logits the sampler drew from (after temperature / top-p / top-k)
        # log-prob of each generated token only (no (B, T, V) stack); (B, T_new)
        logp = torch.stack([s.float().log_softmax(-1).gather(1, new[:, t:t + 1].to(s.device))[:, 0]
                            for t, s in enumerate(out.scores)], 1).cpu() if out.scores else None
        responses, token_logprobs, reasons = [], [], []
        for b in range(new.shape[0]):
            toks = new[b].tolist()
            end = next((j for j, t in enumerate(toks) if t in stops), None) if not ignore_eos else None
            toks = toks if end is None else toks[:end + 1]
            responses.append(toks)
            reasons.append("length" if end is None else "stop")
            token_logprobs.append(logp[b, :len(toks)].tolist() if logp is not None else [])
        return Rollout([p for p in prompt_ids for _ in range(n)], responses, token_logprobs if logprobs else None,
                       reasons)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in named_tensors:
            self.params[name].copy_(t)

    def sleep(self) -> None:
        self.asleep = True
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake(self, tags=None) -> None:
        self.asleep = False  # wakes the whole model whatever the tags
        if self.device.type == "cuda":
            self.model.to(self.device)
