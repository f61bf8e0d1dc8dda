"""Multi-turn rollouts (common/env.py) and the shipped environments (common/environments.py): the calculator's
parser, the episode driver on a scripted engine (the loss mask of a hand-built two-turn episode, token-in/token-out,
the turn and token caps), environment failures counted like reward failures, and the batch's mask and metrics."""
import math
import re

import pytest
import torch

from common.data import PromptExample
from common.env import EnvRunner, Observation, load_env, run_episodes
from common.environments import CALC_INSTRUCTION, CalcError, Calculator, TryAgain, safe_eval
from common.rewards import math_reward
from common.rollout import Rollout, merge_rollouts, rollout_metrics, score_rollout


# ---- the calculator's parser ----------------------------------------------------------------------------------
@pytest.mark.parametrize("expr,value", [("12*7+3", 87), ("(2 + 3) ** 2", 25), ("10/4", 2.5), ("-3 + 1,234", 1231),
                                        ("2 ** -1", 0.5), ("1.5 * 4", 6.0), ("+7 - -2", 9), ("2**64", 2 ** 64)])
def test_calculator_accepts_arithmetic(expr, value):
    assert safe_eval(expr) == value


@pytest.mark.parametrize("expr", [
    "x + 1", "abs(-3)", "__import__('os').system('echo hi')", "(1).real", "[1, 2][0]", "'a' * 3", "1 < 2",
    "lambda: 1", "True + 1", "9 ** 9 ** 9", "2 ** 65", "10 ** 40", "1e300 * 1e300", "1 / 0", "0 ** -1",
    "(-8) ** 0.5", "1 +", "1 " + "+ 1 " * 100, "+".join(["1"] * 40), "1 if 1 else 2", "1 // 2", "7 % 3", "x := 1",
])
def test_calculator_rejects_everything_else(expr):
    with pytest.raises(CalcError):
        safe_eval(expr)


def test_calculator_step_observations():
    env = Calculator()
    obs = env.step([], "First <calc>12*7+3</calc>", None)
    assert (obs.text, obs.tool_call, obs.tool_error, obs.done, obs.role) == ("<result>87</result>", True, False,
                                                                            False, None)
    assert env.step([], "<calc>10/4</calc>", None).text == "<result>2.5</result>"
    obs = env.step([], "<calc>os.system('rm')</calc>", None)  # refused, as an observation
    assert obs.tool_call and obs.tool_error and obs.text.startswith("<result>error:") and not obs.done
    obs = env.step([], "<calc>12*7", None)  # malformed: opened, never closed
    assert obs.tool_error and "malformed" in obs.text and not obs.done
    obs = env.step([], "So the answer is\n#### 87", None)  # no call: the episode is over
    assert obs.done and obs.reward is None and not obs.tool_call


def test_try_again_step():
    env = TryAgain()
    answer = env.reset(PromptExample([1], "q", "work\n#### 87"))
    assert env.step([], "#### 86", answer).role == "user" and env.step([], "#### 86", answer).reward == 0.0
    obs = env.step([], "#### 87", answer)
    assert obs.done and obs.reward == 1.0


def test_load_env():
    assert isinstance(load_env("calculator"), Calculator) and isinstance(load_env("try-again"), TryAgain)
    assert type(load_env("tests.toy_env:Raises")).__name__ == "Raises"
    for spec, msg in (("calc", "expected one of"), ("tests.no_such_module:X", "cannot import"),
                      ("tests.toy_env:Nope", r"no attribute 'Nope' \(a class or function\)"),
                      ("tests.toy_env:NotAnEnv", "without a step")):
        with pytest.raises(ValueError, match=msg):
            load_env(spec)


# ---- the driver, on a scripted engine ---------------------------------------------------------------------------
class ScriptedEngine:
    """generate() answers each context with the tokens `reply(context)` gives (cut at max_new_tokens, then at a stop
    id), and records every call's contexts: an engine whose every output the test knows."""
    timings: dict = {}

    def __init__(self, reply):
        self.reply, self.calls = reply, []

    def generate(self, prompt_ids, n, temperature, seed, logprobs, max_new_tokens, stop_token_ids=(), **_):
        self.calls.append([list(p) for p in prompt_ids for _ in range(n)])
        out, reasons = [], []
        for p in prompt_ids:
            for _ in range(n):
                toks = list(self.reply(list(p)))[:max_new_tokens]
                end = next((j for j, t in enumerate(toks) if t in stop_token_ids), None)
                out.append(toks if end is None else toks[:end + 1])
                reasons.append("stop" if end is not None else "length")
        return Rollout([p for p in prompt_ids for _ in range(n)], out,
                       [[-0.5] * len(r) for r in out] if logprobs else None, reasons)


def runner(env, tok, max_turns=4, max_episode_tokens=200):
    return EnvRunner(env, tok, max_turns, max_episode_tokens, None, "test-env")


def sampling(tok, max_new_tokens=64):
    return {"max_new_tokens": max_new_tokens, "stop_token_ids": [tok.eos_token_id], "top_p": 1.0, "top_k": 0,
            "ignore_eos": False}


def two_turn_episode(tokenizer):
    """A calculator episode built by hand: turn 1 calls the tool (and would go on past the call), turn 2 answers."""
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]
    prompt = enc("What is 12*7+3?")
    turn1 = enc("Let me compute <calc>12*7+3</calc>")
    rambling = enc(" which is 86 I think")  # sampled past the call: cut at the stop string
    # turn 2 starts with " " + "the" (the tokenizer would write " the" as ONE token): re-encoding the context
    # between turns would change these ids, token-in/token-out keeps them
    turn2 = [tokenizer.convert_tokens_to_ids("Ġ"), tokenizer.convert_tokens_to_ids("the")] + enc(
        " answer is\n#### 87") + [tokenizer.eos_token_id]
    obs = enc("<result>87</result>")
    return prompt, turn1, rambling, turn2, obs


def test_two_turn_episode_mask_and_exact_tokens(tokenizer):
    prompt, turn1, rambling, turn2, obs = two_turn_episode(tokenizer)
    engine = ScriptedEngine(lambda ctx: turn1 + rambling if ctx == prompt else turn2)
    example = PromptExample(prompt, "What is 12*7+3?", "#### 87")
    ro = run_episodes(engine, runner(Calculator(), tokenizer), [example], 1, 1.0, 0, sampling(tokenizer), True)
    assert ro.response_ids == [turn1 + obs + turn2]
    assert ro.episodes.loss_mask == [[1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)]
    assert ro.logprobs == [[-0.5] * len(turn1) + [0.0] * len(obs) + [-0.5] * len(turn2)]
    # token-in/token-out: turn 2 continued from the exact ids, which decoding and encoding again would change
    assert engine.calls[1] == [prompt + turn1 + obs]
    assert tokenizer(tokenizer.decode(prompt + turn1 + obs + turn2[:2]), add_special_tokens=False)["input_ids"] != \
        prompt + turn1 + obs + turn2[:2]
    assert (ro.episodes.turns, ro.episodes.tool_calls, ro.episodes.tool_errors, ro.finish_reasons) == \
        ([2], [1], [0], ["stop"])

    # the scored batch: the mask over (B, T) covers the model's tokens only; the reward is --reward-fn's
    part, texts, *_ = score_rollout(ro, [example], math_reward, tokenizer, 0, 0.0, 64, {})
    expected = torch.zeros(1, 64)
    expected[0, :len(turn1)] = 1
    expected[0, len(turn1) + len(obs):len(turn1) + len(obs) + len(turn2)] = 1
    assert torch.equal(part.response_mask(64), expected)
    assert torch.equal(part.engine_mask, expected.bool())  # the engine sampled the model's tokens only
    assert part.rewards.tolist() == [1.0] and "<result>87</result>" in texts[0]
    m = rollout_metrics(part)
    assert (m["rollout/turns_mean"], m["rollout/tool_calls_mean"], m["rollout/tool_errors"]) == (2.0, 1.0, 0)
    assert m["rollout/episode_len_mean"] == len(turn1) + len(obs) + len(turn2)
    assert m["rollout/model_tokens_mean"] == len(turn1) + len(turn2)
    assert (float(m["reward/turn1"]), float(m["reward/turn2"]), float(m["reward/turn4"])) == (0.0, 1.0, 1.0)


def test_single_turn_batch_has_no_env_mask(tokenizer):
    ro = Rollout([[1, 2]], [[5, 6, 7]], None, ["stop"])
    part, *_ = score_rollout(ro, [PromptExample([1, 2], "q", "#### 1")], math_reward, tokenizer, 0, 0.0, 5, {})
    assert part.loss_mask is None and torch.equal(part.response_mask(5), torch.tensor([[1.0, 1, 1, 0, 0]]))
    assert "rollout/turns_mean" not in rollout_metrics(part)


def test_turn_cap_token_cap_and_malformed_call(tokenizer):
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]
    prompt = enc("Q?")
    call = enc("<calc>1+1</calc>")
    example = PromptExample(prompt, "Q?", "#### 2")
    # a model that calls the tool forever: the turn cap ends it after 3 model turns
    engine = ScriptedEngine(lambda ctx: call)
    ro = run_episodes(engine, runner(Calculator(), tokenizer, max_turns=3), [example], 2, 1.0, 0,
                      sampling(tokenizer), False)
    assert ro.episodes.turns == [3, 3] and ro.episodes.tool_calls == [3, 3] and len(engine.calls) == 3
    assert engine.calls[0] == [prompt, prompt]  # the first turn samples n per prompt, like a single-turn rollout
    assert sum(ro.episodes.loss_mask[0]) == 3 * len(call) and ro.logprobs is None
    # ... and the episode budget ends it earlier, truncated, the last turn cut to fit
    ro = run_episodes(ScriptedEngine(lambda ctx: call), runner(Calculator(), tokenizer, max_turns=10,
                      max_episode_tokens=25), [example], 1, 1.0, 0, sampling(tokenizer), False)
    assert len(ro.response_ids[0]) == 25 and ro.finish_reasons == ["length"]
    # a malformed call (the message ended before </calc>) is an error observation, and the model goes on
    bad = enc("<calc>1+") + [tokenizer.eos_token_id]
    answer = enc("#### 2") + [tokenizer.eos_token_id]
    ro = run_episodes(ScriptedEngine(lambda ctx: bad if ctx == prompt else answer), runner(Calculator(), tokenizer),
                      [example], 1, 1.0, 0, sampling(tokenizer), False)
    text = tokenizer.decode(ro.response_ids[0])
    assert ro.episodes.tool_errors == [1] and ro.episodes.turns == [2] and "malformed" in text
    assert "<|im_start|>user" in text  # after the model's end of turn, the error comes as a new message


@pytest.fixture
def one_rank(tmp_path):
    """A process group of one (score_rollout prints its rank with the first error); a file store, no port."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(str(tmp_path / "store"), 1),
                                         rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


class Flaky:
    """Raises on the episodes of odd prompts; others end at once."""
    def reset(self, example):
        return example.prompt_ids[0]

    def step(self, ids, text, first):
        if first % 2:
            raise KeyError("tool server down")
        return Observation(done=True, reward=0.5)


def test_environment_that_raises_is_counted_like_a_reward_error(tokenizer, capsys, one_rank):
    examples = [PromptExample([k], "q", "#### 1") for k in (1, 2, 3, 4)]
    ro = run_episodes(ScriptedEngine(lambda ctx: [7, 8]), runner(Flaky(), tokenizer), examples, 2, 1.0, 0,
                      sampling(tokenizer), False)
    part, *_ = score_rollout(ro, examples, math_reward, tokenizer, 0, 0.0, 8, {})
    assert part.n_errors == 4 and part.n_env_errors == 4  # prompts 1 and 3, two episodes each
    assert part.rewards.tolist() == [0.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.5, 0.5]
    assert "tool server down" in capsys.readouterr().out  # the first error is printed with its episode
    assert rollout_metrics(part)["rollout/env_errors"] == 4
    # an environment that fails every episode stops the run, as a reward function that always raises does
    ro = run_episodes(ScriptedEngine(lambda ctx: [7, 8]), runner(Flaky(), tokenizer), examples[::2], 1, 1.0, 0,
                      sampling(tokenizer), False)
    with pytest.raises(RuntimeError, match="tool server down"):
        score_rollout(ro, examples[::2], math_reward, tokenizer, 0, 0.0, 8, {})


def test_environment_bad_return_and_timeout(tokenizer):
    class Wrong:
        def step(self, ids, text, state):
            return 1.0  # not an Observation

    class Slow:
        def step(self, ids, text, state):
            while True:
                pass

    ex = [PromptExample([1], "q", "#### 1"), PromptExample([2], "q", "#### 1")]
    ro = run_episodes(ScriptedEngine(lambda ctx: [7]), runner(Wrong(), tokenizer), ex, 1, 1.0, 0, sampling(tokenizer),
                      False)
    assert all("not an Observation" in e for e in ro.episodes.errors)
    slow = EnvRunner(Slow(), tokenizer, 2, 8, 0.2, "slow")
    ro = run_episodes(ScriptedEngine(lambda ctx: [7]), slow, ex[:1], 1, 1.0, 0, sampling(tokenizer), False)
    assert ro.episodes.timed_out == [True] and ro.episodes.env_reward == [0.0]


def test_try_again_rewards_by_turn(tokenizer):
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]
    wrong, right = enc("#### 5") + [tokenizer.eos_token_id], enc("#### 7") + [tokenizer.eos_token_id]
    ex = PromptExample(enc("3+4?"), "3+4?", "#### 7")
    # right at the second try
    engine = ScriptedEngine(lambda ctx: right if len(ctx) > len(ex.prompt_ids) else wrong)
    ro = run_episodes(engine, runner(TryAgain(), tokenizer, max_turns=3), [ex], 1, 1.0, 0, sampling(tokenizer), False)
    part, *_ = score_rollout(ro, [ex], math_reward, tokenizer, 0, 0.0, 100, {})
    assert part.turns.tolist() == [2] and part.rewards.tolist() == [1.0]
    assert part.turn_rewards.tolist() == [[0.0, 1.0, 1.0]]
    text = tokenizer.decode(part.response_ids[0])
    assert text == ("#### 5<|im_end|>\n<|im_start|>user\nThat answer is not correct. Check your work and try again."
                    "<|im_end|>\n<|im_start|>assistant\n#### 7<|im_end|>")  # the model's own <|im_end|> kept once
    # never right: k = max_turns - 1 retries, reward 0
    ro = run_episodes(ScriptedEngine(lambda ctx: wrong), runner(TryAgain(), tokenizer, max_turns=3), [ex], 1, 1.0, 0,
                      sampling(tokenizer), False)
    assert ro.episodes.turns == [3] and ro.episodes.env_reward == [0.0]


def test_multi_turn_batches_merge():
    from common.rollout import RolloutBatch
    def part(k):
        return RolloutBatch([[1]] * k, [[2, 3]] * k, torch.zeros(k), torch.zeros(k, dtype=torch.bool),
                            torch.zeros(k, dtype=torch.bool), torch.zeros(k, 4), torch.zeros(k, 4, dtype=torch.bool),
                            None, 0, 0, 1.0, torch.ones(k, 4), torch.ones(k, dtype=torch.long),
                            torch.zeros(k, dtype=torch.long), torch.zeros(k, dtype=torch.long), torch.zeros(k, 2), 1)
    merged = merge_rollouts([part(2), part(3)])
    assert merged.loss_mask.shape == (5, 4) and merged.turn_rewards.shape == (5, 2) and merged.n_env_errors == 2
    assert math.isclose(float(rollout_metrics(merged)["rollout/turns_mean"]), 1.0)


def test_make_env_checks_the_flags(tokenizer):
    from dataclasses import replace

    from common.args import RLArgs
    from common.env import make_env
    base = RLArgs(env="calculator", max_turns=3, max_new_tokens=16)
    assert make_env(RLArgs(), tokenizer) is None  # no --env: single-turn
    runner = make_env(base, tokenizer)
    assert isinstance(runner.env, Calculator) and runner.max_episode_tokens == 48 == base.response_width
    assert base.rollout_max_len == base.max_prompt_tokens + 16 + 48
    assert RLArgs().response_width == RLArgs().max_new_tokens  # single-turn: unchanged
    assert make_env(replace(base, max_episode_tokens=40), tokenizer).max_episode_tokens == 40
    for change, flag in (({"max_turns": 0}, "--max-turns"), ({"max_episode_tokens": 8}, "--max-episode-tokens")):
        with pytest.raises(ValueError, match=flag):
            make_env(replace(base, **change), tokenizer)
    with pytest.raises(ValueError, match="tensor-parallel"):
        make_env(replace(base, rollout="vllm", vllm=replace(base.vllm, tensor_parallel_size=2)), tokenizer)


def test_the_instructions_worked_example_is_what_the_calculator_answers():
    """The prompt shows the model one call and its result; the environment must answer that call with that text."""
    m = re.search(r"(<calc>[^<]*</calc>) gives (<result>[^<]*</result>)", CALC_INSTRUCTION)
    assert m, CALC_INSTRUCTION
    assert Calculator().step([], "Let me compute " + m.group(1), None).text == m.group(2)
