"""dpo.py, common/preference.py and tools/make_pairs.py: losses by hand, data parsing, cache keys, cached vs live
reference, micro-batch invariance, make-pairs, and a 2-rank CPU run."""
import gzip
import json
import math
import os
from pathlib import Path

import pytest
import torch

from common.data import holdout_split
from common.packing import shard_microbatches
from common.preference import (Pair, build_pairs, cache_key, cached_reference_logprobs, pairs_from_samples,
                               reference_logprobs, render_pair, split_shared_messages, split_shared_prefix)
from conftest import run_scripts, torchrun
from dpo import Args, implicit_rewards, pair_losses, preference_loss

ROOT = Path(__file__).resolve().parent.parent
HH = ROOT / "tests" / "data" / "hh-rlhf-harmless" / "test.jsonl.gz"  # 20 pairs, MIT (tests/data)
t = lambda *x: torch.tensor(x, dtype=torch.float64)


# ---- losses by hand -----------------------------------------------------------------------------------------
def test_sigmoid_loss_by_hand():
    # h = (-10 - -11) - (-12 - -11) = 2; beta h = 0.2
    args = t(-10.0), t(-12.0), t(-11.0), t(-11.0)
    assert float(preference_loss(*args, "sigmoid", 0.1)) == pytest.approx(math.log(1 + math.exp(-0.2)), abs=1e-12)
    cdpo = 0.9 * math.log(1 + math.exp(-0.2)) + 0.1 * math.log(1 + math.exp(0.2))
    assert float(preference_loss(*args, "sigmoid", 0.1, label_smoothing=0.1)) == pytest.approx(cdpo, abs=1e-12)
    assert float(preference_loss(t(-1.0), t(-1.0), t(-1.0), t(-1.0), "sigmoid", 0.1)) == pytest.approx(math.log(2))


def test_ipo_loss_by_hand():
    # h = 2, target 1 / (2 * 0.1) = 5 -> (2 - 5)^2 = 9
    assert float(preference_loss(t(-10.0), t(-12.0), t(-11.0), t(-11.0), "ipo", 0.1)) == pytest.approx(9.0)
    assert float(preference_loss(t(-1.0), t(-3.5), t(-1.0), t(-2.5), "ipo", 0.5)) == pytest.approx(0.0)


def test_simpo_loss_by_hand():
    # reference-free: beta (mean logp_c - mean logp_r) - gamma = 2 * 0.5 - 0.5 = 0.5; ref is ignored
    loss = preference_loss(t(-1.0), t(-1.5), t(99.0), t(-99.0), "simpo", 2.0, simpo_gamma=0.5)
    assert float(loss) == pytest.approx(math.log(1 + math.exp(-0.5)), abs=1e-12)


def test_implicit_rewards():
    r = implicit_rewards(t(-10.0, -12.0), t(-11.0, -11.0), 0.1)
    assert r.tolist() == pytest.approx([0.1, -0.1])


# ---- data ---------------------------------------------------------------------------------------------------
def test_split_shared_prefix_cuts_back_to_turn():
    c = "\n\nHuman: hi\n\nAssistant: Sure, here you go.\n\nHuman: thanks\n\nAssistant: Sure thing"
    r = "\n\nHuman: hi\n\nAssistant: Sure, here you go.\n\nHuman: thanks\n\nAssistant: Sure, go away"
    p, cc, rr = split_shared_prefix(c, r)
    assert p == "\n\nHuman: hi\n\nAssistant: Sure, here you go.\n\nHuman: thanks\n\nAssistant:"
    assert (cc, rr) == (" Sure thing", " Sure, go away")
    with pytest.raises(ValueError):
        split_shared_prefix("abc", "abd")


def test_split_real_hh_pairs():
    with gzip.open(HH, "rt") as f:
        rows = [json.loads(next(f)) for _ in range(20)]
    for row in rows:
        p, c, r = split_shared_prefix(row["chosen"], row["rejected"])
        assert p.endswith("\n\nAssistant:") and c.strip() and r.strip()
        assert p + c == row["chosen"] and p + r == row["rejected"]


def test_split_shared_messages():
    u, a1, a2 = ({"role": "user", "content": "q"}, {"role": "assistant", "content": "x"},
                 {"role": "assistant", "content": "y"})
    assert split_shared_messages([u, a1], [u, a2]) == ([u], [a1], [a2])


def test_string_format(tokenizer):
    tok = tokenizer
    rows = [{"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5 or so"}]
    (pair,), dropped = build_pairs(rows, tok, max_length=100)
    assert dropped == 0
    assert pair.prompt_ids == tok("Q: 2+2?\nA:")["input_ids"]
    assert pair.chosen_ids == tok(" 4", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert pair.rejected_ids[-1] == tok.eos_token_id
    assert build_pairs(rows, tok, max_length=len(pair.prompt_ids) + 2) == ([], 1)  # too long: dropped


def test_message_format(tokenizer):
    tok = tokenizer
    prompt = [{"role": "user", "content": "2+2?"}]
    row = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "4"}], "rejected": "5"}
    p, c, r, templated = render_pair(row, tok)
    assert templated and p == tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert c.startswith("4<|im_end|>") and r.startswith("5<|im_end|>")
    (pair,), _ = build_pairs([row], tok, max_length=200)
    assert tok.decode(pair.prompt_ids + pair.chosen_ids) == tok.apply_chat_template(
        prompt + [{"role": "assistant", "content": "4"}], tokenize=False)


def test_system_prompt_and_template_kwargs(tokenizer):
    """--system-prompt and --chat-template-kwargs (dpo.py, rm.py): a message prompt is opened by the system message
    (one of its own is kept) and rendered with the template's variables, as grpo.py renders the same prompt; text
    pairs and HH dialogues get the system prompt and a blank line first, as build_prompts writes text without a
    template; a bad JSON object is refused with the flags' check, before any model loads."""
    import copy
    from common.data import build_prompts
    from common.preference import check_pair_geometry
    tok, system, kw = copy.deepcopy(tokenizer), "Be kind.", {"tag": "T-"}  # the fixture is the session's
    tok.chat_template = ("{% for m in messages %}<{{ tag }}{{ m.role }}>{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}<{{ tag }}assistant>{% endif %}")
    row = {"prompt": "2+2?", "chosen": [{"role": "assistant", "content": "4"}], "rejected": "5"}
    p, c, r, templated = render_pair(row, tok, system_prompt=system, template_kwargs=kw)
    assert (p, c, r, templated) == ("<T-system>Be kind.<T-user>2+2?<T-assistant>", "4", "5", True)
    (grpo_prompt,), _ = build_prompts([row], tok, "prompt", "chosen", None, 100, True, system, kw)
    assert p == grpo_prompt.prompt_text  # the prompt grpo.py generates from with the same flags
    own = dict(row, prompt=[{"role": "system", "content": "Mine."}, {"role": "user", "content": "2+2?"}])
    assert render_pair(own, tok, system_prompt=system, template_kwargs=kw)[0] == "<T-system>Mine.<T-user>2+2?" \
        "<T-assistant>"
    text = {"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5"}
    assert render_pair(text, tok, system_prompt=system) == ("Be kind.\n\nQ: 2+2?\nA:", " 4", " 5", False)
    hh = {"chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "\n\nHuman: hi\n\nAssistant: go"}
    assert render_pair(hh, tok, system_prompt=system)[0] == "Be kind.\n\n\n\nHuman: hi\n\nAssistant:"
    (pair,), _ = build_pairs([row], tok, 100, system_prompt=system, template_kwargs=kw)
    assert tok.decode(pair.prompt_ids) == p
    with pytest.raises(ValueError, match="--chat-template-kwargs '\\[1\\]' is a JSON list"):
        check_pair_geometry(Args(chat_template_kwargs="[1]"), 1)
    check_pair_geometry(Args(chat_template_kwargs='{"enable_thinking": false}', system_prompt=system), 1)
    from common.preference import load_pair_splits  # the flags' way in: dpo.py's and rm.py's data loading
    train, evals, *_ = load_pair_splits(Args(system_prompt=system, eval_size=4), tokenizer, False)
    for p in train[:4] + evals:  # the shipped HH pairs (whole dialogues in text)
        assert tokenizer.decode(p.prompt_ids, skip_special_tokens=True).startswith("Be kind.\n\n\n\nHuman: ")


def test_holdout_split_is_seeded():
    a, b = holdout_split(list(range(100)), 0.1, seed=3)
    assert len(b) == 10 and sorted(a + b) == list(range(100))
    assert holdout_split(list(range(100)), 0.1, seed=3) == (a, b) != holdout_split(list(range(100)), 0.1, seed=4)


# ---- reference cache ----------------------------------------------------------------------------------------
def test_cache_key(tmp_path, tiny_model_dir):
    pairs = [Pair([1, 2], [3], [4, 5])]
    spec = {"dataset": "a.jsonl", "max_length": 512, "chat_template": "T"}
    key = cache_key(str(tiny_model_dir), pairs, spec)
    assert key == cache_key(str(tiny_model_dir), pairs, dict(spec))
    for change in ({"dataset": "b.jsonl"}, {"max_length": 256}, {"chat_template": "U"}):
        assert cache_key(str(tiny_model_dir), pairs, spec | change) != key
    assert cache_key(str(tiny_model_dir), [Pair([1, 2], [3], [4, 6])], spec) != key  # other tokens
    other = tmp_path / "copy"
    other.mkdir()
    for f in tiny_model_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    assert cache_key(str(other), pairs, spec) != key  # other path
    cfg = json.loads((other / "config.json").read_text())
    k2 = cache_key(str(other), pairs, spec)
    (other / "config.json").write_text(json.dumps(cfg | {"rms_norm_eps": 1e-5}))
    assert cache_key(str(other), pairs, spec) != k2  # other config


def _tiny_policy(path):
    from common.models import TokenLogProbs, load_causal_lm
    return TokenLogProbs(load_causal_lm(str(path)), "torch")


def _pairs(tok, n=6):
    rows = [{"prompt": f"Question {i}: what is {i} + {i}?", "chosen": f" It is {2 * i}.",
             "rejected": " I do not know" + "!" * i} for i in range(n)]
    return build_pairs(rows, tok, max_length=256)[0]


def test_cached_reference_matches_live(tmp_path, tiny_model_dir, tokenizer):
    pairs, ids = _pairs(tokenizer), [0, 1, 2, 3, 4, 5]
    ref = _tiny_policy(tiny_model_dir).eval()
    calls = []

    def compute():
        calls.append(1)
        return reference_logprobs(ref, pairs, 1, 0, budget=60, device=torch.device("cpu"))
    table, hit = cached_reference_logprobs(str(tmp_path), "k", compute, {})
    again, hit2 = cached_reference_logprobs(str(tmp_path), "k", compute, {})
    assert (hit, hit2, len(calls)) == (False, True, 1) and torch.equal(table, again)
    assert not list(tmp_path.glob("*.tmp*"))  # written atomically
    torch.manual_seed(0)
    policy = _tiny_policy(tiny_model_dir)
    with torch.no_grad():  # move the policy away from the reference so the loss is not log 2
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    for loss in ("sigmoid", "ipo"):
        args = Args(loss=loss)
        cached, rc, _ = pair_losses(policy, pairs, ids, table, None, args, torch.device("cpu"))
        live, rl, _ = pair_losses(policy, pairs, ids, None, ref, args, torch.device("cpu"))
        torch.testing.assert_close(cached, live, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rc, rl, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(cached, torch.full_like(cached, math.log(2)))


@pytest.mark.parametrize("loss", ["sigmoid", "simpo"])
def test_microbatch_split_gives_same_gradient(tiny_model_dir, tokenizer, loss):
    pairs, batch = _pairs(tokenizer), [5, 0, 3, 1, 4, 2]
    lengths = [p.num_tokens for p in pairs]
    policy = _tiny_policy(tiny_model_dir)
    ref_table = torch.randn(len(pairs), 2) - 30
    grads = []
    for budget in (10_000, max(lengths)):
        micro = shard_microbatches(lengths, batch, 1, 0, budget)
        assert (len(micro) == 1) == (budget == 10_000)
        policy.zero_grad()
        for ids in micro:
            losses, _, _ = pair_losses(policy, pairs, ids, ref_table, None, Args(loss=loss), torch.device("cpu"))
            (losses.sum() / len(batch)).backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


# ---- make-pairs ---------------------------------------------------------------------------------------------
def test_pairs_from_samples():
    rows = pairs_from_samples(["q1", "q2"], [["a", "b", "c"], ["d", "e"]], [[1, 0, 1], [0, 0]], pairs_per_prompt=2)
    assert rows == [{"prompt": [{"role": "user", "content": "q1"}], "chosen": [{"role": "assistant", "content": "a"}],
                     "rejected": [{"role": "assistant", "content": "b"}]}]
    assert pairs_from_samples(["q"], [["a", "b"]], [[0, 1]], templated=False) == [
        {"prompt": "q", "chosen": "b", "rejected": "a"}]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}]  # a chat prompt: as it is
    assert pairs_from_samples([chat], [["a", "b"]], [[1, 0]])[0]["prompt"] == chat
    assert pairs_from_samples([chat], [["a", "b"]], [[1, 0]], templated=False)[0]["prompt"] == "Be brief.\n\nq"


@pytest.fixture(scope="module")
def make_pairs(tmp_path_factory, tiny_model_dir) -> dict:
    """`python -m tools.make_pairs` with a reward of the completion's parity, on the default prompts ("plain") and on
    verl-shaped chat rows ("chat"): each case's written rows and stdout."""
    tmp = tmp_path_factory.mktemp("make_pairs")
    (tmp / "parity_reward.py").write_text("def reward(prompt, completion, answer):\n    return float(len(completion) % 2)\n")
    data = tmp / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": CHAT_PROMPT(i), "reward_model": {"ground_truth": str(i + 1)}}) + "\n"
                            for i in range(4)))
    flags = {"plain": ["--num-prompts", "6"],
             "chat": ["--dataset", str(data), "--prompt-field", "prompt", "--answer-field", "reward_model.ground_truth",
                      "--num-prompts", "4"]}
    runs = run_scripts({k: ["-m", "tools.make_pairs", "--out", str(tmp / f"{k}.jsonl"), "--model", str(tiny_model_dir),
                            "--samples", "6", "--max-new-tokens", "6", "--reward-fn", "parity_reward:reward",
                            "--rollout", "hf", *f] for k, f in flags.items()}, tmp / "driver",
                       env={"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp}"})
    for p in runs.values():
        assert p.returncode == 0, p.stderr[-3000:]
    return {k: ([json.loads(line) for line in (tmp / f"{k}.jsonl").read_text().splitlines()], runs[k].stdout)
            for k in flags}


CHAT_PROMPT = lambda i: [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i} + 1?"}]


def test_make_pairs_cli(make_pairs, tokenizer):
    rows, stdout = make_pairs["plain"]
    assert rows, stdout
    for row in rows:
        assert len(row["chosen"][0]["content"]) % 2 == 1 and len(row["rejected"][0]["content"]) % 2 == 0
    pairs, dropped = build_pairs(rows, tokenizer, max_length=512)  # dpo.py reads what it writes
    assert len(pairs) == len(rows) and dropped == 0


def test_make_pairs_from_chat_prompts_and_nested_answers(make_pairs, tokenizer):
    """verl-shaped rows: the pairs keep each chat prompt as it is (it was str()-ed into one user message)."""
    rows, _ = make_pairs["chat"]
    assert rows and all(row["prompt"] in [CHAT_PROMPT(i) for i in range(4)] for row in rows), rows[:1]
    assert len(build_pairs(rows, tokenizer, max_length=512)[0]) == len(rows)


# ---- end to end ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_dpo_two_ranks_cpu(tmp_path, tiny_model_dir):
    data = tmp_path / "pairs.jsonl"
    with open(data, "w") as f:
        for i in range(16):
            f.write(json.dumps({"chosen": f"\n\nHuman: what is {i} + {i}?\n\nAssistant: It is {2 * i}.",
                                "rejected": f"\n\nHuman: what is {i} + {i}?\n\nAssistant: No idea" + "!" * i}) + "\n")
    args = ["--model", str(tiny_model_dir), "--dataset", str(data), "--pairs-per-step", "4",
            "--num-steps", "2", "--eval-fraction", "0.25", "--eval-every", "1", "--max-length", "128",
            "--max-tokens-per-microbatch", "256", "--lr", "1e-3", "--out-dir", str(tmp_path / "out"),
            "--cache-dir", str(tmp_path / "cache")]
    for run in ("computed", "hit"):  # the second also keeps the parameters gathered between micro-batches, and
        # starts over in the same run folder (--overwrite; the reference cache lives in --cache-dir, not there)
        p = torchrun("dpo.py", *args, *(["--fsdp.keep-gathered", "on", "--overwrite"] if run == "hit" else []))
        assert f"cached ({run}" in p.stdout
        merged = {}  # an evaluation is a row of its own at the step whose weights it measured: merge by step
        for line in (tmp_path / "out" / "dpo" / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            merged.setdefault(row["step"], {}).update(row)
        rows = [merged[k] for k in sorted(merged)]
        assert [r["step"] for r in rows] == [0, 1, 2] and "train/loss" not in rows[2]  # 2: the final evaluation
        assert rows[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference at step 0
        assert rows[0]["eval/rewards/margin"] == pytest.approx(0.0, abs=1e-4)
        for k in ("train/rewards/chosen", "train/rewards/rejected", "train/rewards/accuracy", "train/grad_norm",
                  "train/lr", "perf/step_s", "eval/rewards/accuracy"):
            assert all(math.isfinite(r[k]) for r in rows if k in r) and k in rows[0]
        assert rows[1]["train/loss"] != pytest.approx(math.log(2), abs=1e-6)  # the policy moved
        if run == "computed":
            first = rows
        else:
            assert [r["train/loss"] for r in rows[:2]] == pytest.approx([r["train/loss"] for r in first[:2]])
    config = json.loads((tmp_path / "out" / "dpo" / "config.json").read_text())
    assert config["train_pairs"] == 12 and config["eval_pairs"] == 4 and config["world_size"] == 2
