"""Multi-turn episodes through the trainer's real log-prob code (common/passes.py, TokenLogProbs, kernels'
token_logprobs): the model's tokens of a packed multi-turn sequence get the log-probs a turn-by-turn forward gives,
and those the HF engine sampled them with; the scripts end to end with --env."""
import json
import math

import pytest
import torch

from common.data import PromptExample
from common.env import EnvRunner, Observation, run_episodes
from common.models import TokenLogProbs, load_causal_lm
from common.passes import sequence_logprobs
from common.rollout import HFEngine
from conftest import torchrun


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


# ---- the scripts, end to end -------------------------------------------------------------------------------------
def read_rows(run_dir):
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r for r in rows if "reward/mean" in r], [r for r in rows if "eval/accuracy" in r]


MULTI_TURN_KEYS = ("rollout/turns_mean", "rollout/tool_calls_mean", "rollout/tool_errors", "rollout/env_errors",
                   "rollout/episode_len_mean", "rollout/model_tokens_mean", "reward/turn1", "reward/turn3")


@pytest.mark.slow
def test_grpo_calculator_end_to_end(tiny_model_dir, tmp_path):
    """grpo.py --env calculator on the HF engine: the multi-turn metrics are logged, training and evaluation with
    the environment run (a random tiny model never calls the tool: one turn each)."""
    torchrun("grpo.py", "--model", str(tiny_model_dir), "--num-steps", "2", "--prompts-per-step", "2",
             "--group-size", "2", "--max-new-tokens", "8", "--env", "calculator", "--max-turns", "3",
             "--eval-every", "2", "--eval-size", "2", "--out-dir", str(tmp_path), "--exp-name", "calc", nproc=1)
    train, evals = read_rows(tmp_path / "calc")
    assert [r["step"] for r in train] == [0, 1] and [r["step"] for r in evals] == [0, 2]
    for r in train:
        for k in MULTI_TURN_KEYS:
            assert k in r, k
        assert 1 <= r["rollout/turns_mean"] <= 3 and math.isfinite(r["train/loss"])
    assert all("eval/tool_calls_mean" in r and "eval/turns_mean" in r for r in evals)


@pytest.mark.slow
@pytest.mark.parametrize("script,nproc", [("grpo.py", 2), ("ppo.py", 1)])
def test_multi_turn_training_end_to_end(tiny_model_dir, tmp_path, script, nproc):
    """Real multi-turn episodes (tests.toy_env:EveryE answers every turn) through the whole script: environment
    tokens are in the sequences but not in the loss, and the engine's log-probs of the model's tokens match the
    trainer's (token-in/token-out end to end; 2 ranks for GRPO: the multi-turn fields cross the gather)."""
    flags = ["--group-size", "2"] if script == "grpo.py" else ["--num-minibatches", "1", "--num-epochs", "1"]
    torchrun(script, "--model", str(tiny_model_dir), "--num-steps", "2", "--prompts-per-step", "2", *flags,
             "--max-new-tokens", "8", "--env", "tests.toy_env:EveryE", "--max-turns", "3",
             "--reward-fn", "tests.toy_reward:letters", "--kl-coef", "0.05", "--engine-logprobs-every", "1",
             "--eval-every", "0", "--out-dir", str(tmp_path), "--exp-name", "mt", nproc=nproc)
    train, _ = read_rows(tmp_path / "mt")
    assert [r["step"] for r in train] == [0, 1]
    for r in train:
        assert r["rollout/turns_mean"] > 1 and r["rollout/tool_calls_mean"] > 0
        assert r["rollout/model_tokens_mean"] < r["rollout/episode_len_mean"] <= 24  # 3 turns x 8 tokens at most
        assert r["rollout/logprob_gap_max"] < 1e-3  # HF engine and trainer share weights: the same log-probs
        for k in ("train/loss", "train/kl", "train/entropy", "train/grad_norm"):
            assert math.isfinite(r[k]), k


# ---- PPO: GAE over the model's tokens only ----------------------------------------------------------------------
def test_gae_skips_environment_tokens():
    """An episode with environment tokens between its turns gets, on its model tokens, the advantages and returns
    of the same episode with the environment tokens taken out (ppo.py's gae and token_rewards on the real mask)."""
    import ppo
    torch.manual_seed(0)
    mask = torch.tensor([[1.0, 1, 0, 0, 0, 1, 1, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]])  # (2, 11)
    model = mask.bool()
    values = torch.randn(2, 11) * mask
    logp, ref_logp = torch.randn(2, 11), torch.randn(2, 11)
    task, last_v = torch.tensor([1.0, -0.5]), torch.tensor([0.0, 0.3])
    r = ppo.token_rewards(task, logp, ref_logp, mask, 0.1, torch.tensor([True, True]))
    assert r[0, 8] == pytest.approx(task[0] - 0.1 * (logp[0, 8] - ref_logp[0, 8]))  # R at the last MODEL token
    assert (r[~model] == 0).all()
    adv, ret = ppo.gae(r, values, mask, last_v, 0.9, 0.8)
    assert (adv[~model] == 0).all() and (ret[~model] == 0).all()
    for i in range(2):
        m = model[i]
        n = int(m.sum())
        c_adv, c_ret = ppo.gae(r[i, m][None], values[i, m][None], torch.ones(1, n), last_v[i:i + 1], 0.9, 0.8)
        torch.testing.assert_close(adv[i, m], c_adv[0])
        torch.testing.assert_close(ret[i, m], c_ret[0])


def test_calculator_recipe_flags_parse(monkeypatch, tokenizer):
    """runs/grpo_gsm8k_qwen05b_calculator.sh (not run on CPU: a GPU recipe) passes flags grpo.py accepts, and its
    episodes fit the micro-batch budget and the environment's checks."""
    import sys

    import grpo
    from common.args import cli
    from common.env import make_env
    from conftest import recipe_flags

    # the calculator recipe is the plain one's flags, then its own (later flags win)
    argv = (recipe_flags("grpo_gsm8k_qwen05b.sh", '"${SCRIPT:-grpo.py}" \\\n')
            + recipe_flags("grpo_gsm8k_qwen05b_calculator.sh", "exec bash runs/grpo_gsm8k_qwen05b.sh",
                           {"$INSTRUCTION": "CALC"}))
    monkeypatch.setattr(sys, "argv", ["grpo.py", *argv])
    args = cli(grpo.Args)
    assert (args.env, args.max_turns, args.response_width, args.rollout) == ("calculator", 4, 1024, "vllm")
    assert args.max_tokens_per_microbatch >= args.max_prompt_tokens + args.response_width
    assert make_env(args, tokenizer).max_episode_tokens == 1024
