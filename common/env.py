"""Multi-turn and tool-using rollouts: the environment interface, `--env` loading, and the episode driver.

An environment is any object with a `step` method (and, optionally, `reset`):

    from common.env import Observation

    class Echo:                                        # --env mymodule:Echo
        stop = ("</ask>",)                             # optional: a model turn also ends at these strings
        def reset(self, example):                      # optional: per-episode state (example.prompt_text, .answer)
            return {"calls": 0}
        def step(self, ids, text, state):              # ids: the whole conversation; text: the model's last turn
            if "<ask>" not in text:
                return Observation(done=True)          # reward None: --reward-fn scores the episode
            state["calls"] += 1
            question = text.split("<ask>")[-1].removesuffix("</ask>")
            return Observation(text=f"<answer>{question.upper()}</answer>", tool_call=True)

`step(ids, text, state)` gets the exact token ids of the conversation so far (prompt + every turn, as sampled and as
appended: nothing is decoded and encoded again), the decoded text of the model's latest turn, and the state `reset`
returned (None without `reset`). It returns an Observation: the tokens to append (`tokens`, or `text` to tokenise;
with `role` the text is a new chat message formatted by the chat template, without it the text continues the model's
message in-line, as a tool result does), the reward so far (None: none yet), and whether the episode is over.
The shipped environments are in common/environments.py ("calculator", "try-again"); docs/multiturn.md has the rest.

The driver (run_episodes) alternates engine.generate over every open episode (token ids in, token ids out, the same
call as a single-turn rollout, so vLLM's prefix cache serves the earlier turns) with env.step, until the environment
says done, --max-turns model turns, or --max-episode-tokens tokens after the prompt. Environment tokens are in the
context but out of the loss (Rollout.loss_mask: 1 on the model's tokens, 0 on the environment's). An environment that
raises or runs past --reward-timeout ends its episode with reward 0, counted like a failing reward function.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.errors import UsageError
from common.rewards import RewardTimeout, _call_with_timeout, _short, import_callable
from common.rollout import Episodes, Rollout


@dataclass
class Observation:
    """What an environment returns after each model turn."""
    text: str | None = None          # appended after the model's turn (tokenised; see `role`)
    tokens: list[int] | None = None  # or the exact token ids to append (wins over text)
    reward: float | None = None      # the reward so far (None: not given; the last one given is the episode's)
    done: bool = False               # the episode is over (nothing is appended)
    role: str | None = None          # None: text continues the model's message; "user"/"tool": a new chat message
    tool_call: bool = False          # the turn held a tool call (rollout/tool_calls_mean)
    tool_error: bool = False         # ... that failed: malformed or its evaluation raised (rollout/tool_errors)


@dataclass
class EnvRunner:
    """An environment and the episode limits: what the scripts pass to generate(..., env=) and evaluate."""
    env: object
    tok: object                  # the tokenizer: decodes turns for step(), tokenises text observations
    max_turns: int               # model turns per episode
    max_episode_tokens: int      # tokens after the prompt (model + environment); the response tensors are this wide
    timeout_s: float | None      # per reset/step call (--reward-timeout)
    name: str = "env"


def load_env(spec: str):
    """The environment of --env: "calculator", "try-again", or "pkg.module:Name" (a class or a function, called with
    no arguments; the current folder is importable, as for --reward-fn)."""
    from common.environments import BUILTIN_ENVS
    if spec in BUILTIN_ENVS:
        return BUILTIN_ENVS[spec]()
    if ":" not in spec:
        raise UsageError(f"--env {spec}: expected one of {sorted(BUILTIN_ENVS)} or 'pkg.module:Name'")
    factory = import_callable(spec, "--env", "class or function")
    env = factory()
    if not callable(getattr(env, "step", None)):
        raise UsageError(f"--env {spec}: {spec.replace(':', '.')}() gave a {type(env).__name__} without a step(ids, "
                         f"text, state) method (docs/multiturn.md)")
    return env


def make_env(args, tok) -> EnvRunner | None:
    """The scripts' environment from --env, --max-turns, --max-episode-tokens, --reward-timeout (None without
    --env). Checks the limits and the engine layout, naming the flag to change."""
    if not args.env:
        return None
    if args.max_turns < 1:
        raise UsageError(f"--max-turns {args.max_turns}: an episode needs at least one model turn")
    if args.response_width < args.max_new_tokens:
        raise UsageError(f"--max-episode-tokens {args.max_episode_tokens} is below --max-new-tokens "
                         f"{args.max_new_tokens}: one turn alone would not fit; raise it (0: max_turns x "
                         f"max_new_tokens)")
    if getattr(args, "overlong", "none") == "soft":  # grpo.py's DAPO penalty counts from --max-new-tokens
        raise UsageError("--overlong soft with --env: an episode is longer than one turn's --max-new-tokens; use "
                         "--overlong penalty or mask (truncated episodes) or none")
    if args.rollout != "hf" and args.vllm.tensor_parallel_size > 1:  # every TP rank must call generate alike
        raise UsageError("--env with --vllm.tensor-parallel-size > 1: the ranks of one engine would run different "
                         "numbers of turns; use tensor-parallel size 1 (data parallel) for multi-turn rollouts")
    return EnvRunner(load_env(args.env), tok, args.max_turns, args.response_width, args.reward_timeout or None,
                     args.env)


def chat_message_ids(tok, text: str, role: str, after_eos: bool) -> list[int]:
    """Token ids that close the model's message (its end-of-turn token unless `after_eos`: the model wrote it), open
    a `role` message holding `text`, and open the assistant's next message: the chat template's own rendering,
    taken as the suffix after a conversation that ends in an assistant message."""
    if getattr(tok, "chat_template", None) is None:
        return tok(f"\n{role}: {text}\n", add_special_tokens=False)["input_ids"]
    marker = "ASSISTANT-TURN-7f3c"  # text no template writes itself, so what follows it is the template's
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": marker}]
    before = tok.apply_chat_template(base, tokenize=False)
    full = tok.apply_chat_template(base + [{"role": role, "content": text}], tokenize=False,
                                   add_generation_prompt=True)
    tail = before[before.rindex(marker) + len(marker):]  # what closes an assistant message ("<|im_end|>\n": ChatML)
    if after_eos and tok.eos_token and tail.startswith(tok.eos_token):
        tail = tail[len(tok.eos_token):]  # the model's own end-of-turn token is already in the context
    return tok(tail + full[len(before):], add_special_tokens=False)["input_ids"]


def cut_at_stop(tok, toks: list[int], stops) -> list[int] | None:
    """The shortest prefix of `toks` whose text holds one of the stop strings, or None (the engines stop on token
    ids; a prefix of a sample is a sample, so cutting here keeps the turn on-policy)."""
    if not stops or not any(s in tok.decode(toks) for s in stops):
        return None
    lo, hi = 1, len(toks)  # holds(k) is monotone in k: binary search for the first k where it holds
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in tok.decode(toks[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return toks[:lo]


def _call_env(runner: EnvRunner, fn, *args):
    """fn(*args) under the timeout: (result, None) or (None, (message, timed_out))."""
    try:
        return _call_with_timeout(fn, args, runner.timeout_s), None
    except RewardTimeout as e:
        return None, (str(e), True)
    except Exception as e:
        return None, (f"{type(e).__name__}: {e}", False)


def run_episodes(engine, runner: EnvRunner, examples, n: int, temperature: float, seed: int, sampling: dict,
                 logprobs: bool) -> Rollout:
    """n episodes per example (prompt-major, like a single-turn Rollout), generated turn by turn: each turn, one
    engine.generate call over every open episode's exact token ids; then env.step on each. The Rollout's
    response_ids are the episode after the prompt (model and environment tokens), its loss_mask marks the model's,
    its logprobs hold 0.0 at environment tokens, and its `episodes` the per-episode counts (common.rollout.Episodes)."""
    tok, env = runner.tok, runner.env
    B = len(examples) * n
    prompts = [e.prompt_ids for e in examples for _ in range(n)]
    resp, mask, lps = [[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)]
    reasons, turns, calls, tool_errs = ["stop"] * B, [0] * B, [0] * B, [0] * B
    env_reward: list[float | None] = [None] * B
    turn_rewards = [[] for _ in range(B)]
    errors: list[str | None] = [None] * B
    timed_out = [False] * B
    states, open_ = [None] * B, set(range(B))
    stops = tuple(getattr(env, "stop", ()) or ())

    def fail(i, message, is_timeout):
        errors[i], timed_out[i] = message, is_timeout
        env_reward[i] = 0.0
        open_.discard(i)

    if hasattr(env, "reset"):
        for i in range(B):
            states[i], err = _call_env(runner, env.reset, examples[i // n])
            if err:
                fail(i, f"reset: {err[0]}", err[1])
    for turn in range(runner.max_turns):
        active = sorted(open_)
        if not active:
            break
        room = {i: runner.max_episode_tokens - len(resp[i]) for i in active}
        cap = min(sampling["max_new_tokens"], max(room.values()))
        kw = sampling | {"max_new_tokens": cap}
        if turn == 0 and len(active) == B:  # the first turn: n samples of each prompt, as a single-turn rollout
            out = engine.generate([e.prompt_ids for e in examples], n=n, temperature=temperature,
                                  seed=seed, logprobs=logprobs, **kw)
        else:  # token-in/token-out: each open episode continues from its exact ids
            out = engine.generate([prompts[i] + resp[i] for i in active], n=1, temperature=temperature,
                                  seed=seed + 7919 * turn, logprobs=logprobs, **kw)
        for j, i in enumerate(active):
            toks, reason = out.response_ids[j], out.finish_reasons[j]
            lp = out.logprobs[j] if out.logprobs is not None else []
            if (cut := cut_at_stop(tok, toks, stops)) is not None:  # the environment's stop string ends the turn
                toks, reason = cut, "stop"
            if len(toks) > room[i]:  # the episode's token budget ends it
                toks, reason = toks[:room[i]], "length"
            resp[i] += toks
            mask[i] += [1] * len(toks)
            lps[i] += (list(lp) + [0.0] * len(toks))[:len(toks)]
            turns[i] += 1
            obs, err = _call_env(runner, env.step, prompts[i] + resp[i],
                                 tok.decode(toks, skip_special_tokens=True), states[i])
            if err is None and not isinstance(obs, Observation):
                err = (f"step returned {type(obs).__name__} {_short(obs, 60)}, not an Observation", False)
            if err is None and not obs.done and obs.tokens is None and obs.text is None:
                err = ("step returned an Observation with no text or tokens that is not done", False)
            if err:
                fail(i, f"step (turn {turn + 1}): {err[0]}", err[1])
                continue
            calls[i] += obs.tool_call
            tool_errs[i] += obs.tool_error
            if obs.reward is not None:
                env_reward[i] = float(obs.reward)
            turn_rewards[i].append(obs.reward)
            if reason == "length":  # cut by --max-new-tokens or the episode budget: the episode is truncated
                reasons[i] = "length"
                open_.discard(i)
                continue
            if obs.done or turn + 1 == runner.max_turns:
                open_.discard(i)
                continue
            ended_turn = bool(toks) and toks[-1] in (sampling.get("stop_token_ids") or [])
            new = list(obs.tokens) if obs.tokens is not None else (
                chat_message_ids(tok, obs.text, obs.role, ended_turn) if obs.role else
                tok(obs.text, add_special_tokens=False)["input_ids"])
            if len(resp[i]) + len(new) >= runner.max_episode_tokens:  # no room left for the model to answer
                reasons[i] = "length"
                open_.discard(i)
                continue
            resp[i] += new
            mask[i] += [0] * len(new)
            lps[i] += [0.0] * len(new)
    return Rollout(prompts, resp, lps if logprobs else None, reasons,
                   Episodes(mask, turns, calls, tool_errs, env_reward, turn_rewards, errors, timed_out,
                            runner.max_turns, runner.name))
