"""Multi-turn episodes through the trainer's real log-prob code (common/passes.py, TokenLogProbs, kernels'
token_logprobs): the model's tokens of a packed multi-turn sequence get the log-probs a turn-by-turn forward gives,
and those the HF engine sampled them with; the scripts end to end with --env."""
import json

import pytest
import torch

from common.data import PromptExample
from common.env import EnvRunner, Observation, run_episodes
from common.models import TokenLogProbs, load_causal_lm
from common.passes import sequence_logprobs
from common.rollout import HFEngine


class Chatty:
    """Never done: answers every model turn, in-line after odd turns and as a user message after even ones."""
    def reset(self, example):
        return [0]

    def step(self, ids, text, state):
        state[0] += 1
        if state[0] % 2:
            return Observation(text=" <result>42</result> ", tool_call=True)
        return Observation(text="Go on.", role="user")


def trainer_logp(model, prompts, responses, width):
    """The scripts' no-grad log-prob pass (world 1): (B, width)."""
    return sequence_logprobs(model, prompts, responses, list(range(len(prompts))), 1, 0, 100_000, 1.0, width,
                             torch.device("cpu"))


@pytest.fixture(scope="module")
def episodes(tiny_model_dir, tokenizer):
    """Episodes of the tiny model with the HF engine and the real driver. The random model rarely writes its
    end-of-turn token, so every 12th token id also ends a turn: turns of a few tokens, several turns an episode."""
    engine = HFEngine(str(tiny_model_dir), torch.device("cpu"), pad_token_id=tokenizer.pad_token_id)
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]
    examples = [PromptExample(enc(q), q, "#### 1") for q in ("What is 2+2?", "Add 3 and 5.", "Say hi.")]
    stops = list(range(0, len(tokenizer), 12))
    sampling = {"max_new_tokens": 40, "stop_token_ids": stops, "top_p": 1.0,
                "top_k": len(tokenizer)}  # top_k = V: no filtering, so the engine's log-probs are the model's
    runner = EnvRunner(Chatty(), tokenizer, 4, 200, None, "chatty")
    return run_episodes(engine, runner, examples, 2, 1.0, 3, sampling, True)


def turns_of(mask):
    """[(start, end)] of each run of model tokens in a loss mask."""
    spans, start = [], None
    for j, m in enumerate(mask + [0]):
        if m and start is None:
            start = j
        if not m and start is not None:
            spans.append((start, j))
            start = None
    return spans


def test_packed_multi_turn_logprobs_equal_turn_by_turn(tiny_model_dir, episodes):
    ro, width = episodes, 200
    multi = [i for i, m in enumerate(ro.episodes.loss_mask) if len(turns_of(m)) >= 2]
    assert len(multi) >= 2, f"too few multi-turn episodes to test: turns {ro.episodes.turns}"
    model = TokenLogProbs(load_causal_lm(str(tiny_model_dir), "sdpa", trainable=False), impl="torch")
    packed = trainer_logp(model, ro.prompt_ids, ro.response_ids, width)  # (B, T) every episode in one packed pass
    # turn by turn: each model turn as the response to everything before it (prompt, earlier turns, observations)
    ctx, turn, where = [], [], []
    for i in multi:
        for s, e in turns_of(ro.episodes.loss_mask[i]):
            ctx.append(ro.prompt_ids[i] + ro.response_ids[i][:s])
            turn.append(ro.response_ids[i][s:e])
            where.append((i, s, e))
    alone = trainer_logp(model, ctx, turn, width)
    for k, (i, s, e) in enumerate(where):
        torch.testing.assert_close(packed[i, s:e], alone[k, :e - s], atol=1e-5, rtol=0)
    # ... and the engine sampled the model's tokens with those log-probs (generated turn by turn, left-padded)
    for i in multi:
        m = torch.tensor(ro.episodes.loss_mask[i], dtype=torch.bool)
        engine_lp = torch.tensor(ro.logprobs[i])
        torch.testing.assert_close(engine_lp[m], packed[i, :len(m)][m], atol=2e-4, rtol=0)
        assert (engine_lp[~m] == 0).all() and (~m).any()  # environment tokens: no sampling log-prob


def test_episode_is_prompt_turns_and_observations(tokenizer, episodes):
    ro = episodes
    for i, mask in enumerate(ro.episodes.loss_mask):
        assert len(mask) == len(ro.response_ids[i]) <= 200
        spans = turns_of(mask)
        assert len(spans) == ro.episodes.turns[i] <= 4
        if len(spans) >= 2:  # the first observation is the in-line tool result, exactly as tokenised
            s, e = spans[0][1], spans[1][0]
            assert ro.response_ids[i][s:e] == tokenizer(" <result>42</result> ", add_special_tokens=False)["input_ids"]
    assert sum(ro.episodes.tool_calls) >= 2
