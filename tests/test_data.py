import json
import re

import pytest

import common.data as data
from common.errors import UsageError
from common.data import (
    DEFAULT_INSTRUCTION,
    PromptExample,
    PromptSampler,
    build_prompts,
    chat_template_kwargs,
    load_rows,
    make_arithmetic_rows,
)


# ---------------------------------------------------------------------------- load_rows


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_load_rows_jsonl_skips_blank_lines(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "a", "answer": "1"}\n\n{"question": "b", "answer": "2"}\n   \n')
    assert load_rows(str(path), "train") == [{"question": "a", "answer": "1"}, {"question": "b", "answer": "2"}]


def test_load_rows_corrupted_line_is_named(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "a", "answer": "1"}\n\n{"question": "b", "answ\n{"question": "c"}\n')
    with pytest.raises(ValueError, match=r"train\.jsonl line 3 is not valid JSON"):
        load_rows(str(path), "train")


def test_load_rows_parquet_json_and_folder(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "file.parquet")
    assert load_rows(str(tmp_path / "file.parquet"), "train") == rows
    (tmp_path / "file.json").write_text(json.dumps(rows))
    assert load_rows(str(tmp_path / "file.json"), "train") == rows

    folder = tmp_path / "ds"
    folder.mkdir()
    _write_jsonl(folder / "train.jsonl", rows[:3])
    pq.write_table(pa.Table.from_pylist(rows[3:]), folder / "test.parquet")
    assert load_rows(str(folder), "train") == rows[:3]
    assert load_rows(str(folder), "test") == rows[3:]
    with pytest.raises(UsageError, match=r"no file for split 'validation'.*test\.parquet.*train\.jsonl"):
        load_rows(str(folder), "validation")


def test_load_rows_unknown_spec(tmp_path, monkeypatch):
    with pytest.raises(UsageError, match="does not exist"):
        load_rows(str(tmp_path / "missing.jsonl"), "train")

    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match=r"(?s)not a local file or folder.*hub.*ConnectionError.*local \.jsonl"):
        load_rows("some-org/some-dataset", "train")


def test_load_rows_hub_path_uses_load_dataset(monkeypatch):
    import datasets

    calls = []

    def fake(spec, config, split):
        calls.append((spec, config, split))
        return datasets.Dataset.from_list([{"question": "q", "answer": "1"}])

    monkeypatch.setattr(datasets, "load_dataset", fake)
    assert load_rows("openai/gsm8k", "test", "main") == [{"question": "q", "answer": "1"}]
    assert calls == [("openai/gsm8k", "main", "test")]


# ---------------------------------------------------------------------------- arithmetic task


def _evaluate(row):
    """The '####' answer recomputed from the worked line's own arithmetic."""
    work, final = row["answer"].rsplit("\n#### ", 1)
    for lhs, rhs in re.findall(r"(\d+(?: [-+x] \d+)+) = (\d+)", work):
        assert eval(lhs.replace("x", "*")) == int(rhs), row
    return int(final)


def test_arith_rows_deterministic_and_correct():
    a, b = make_arithmetic_rows(300, seed=5), make_arithmetic_rows(300, seed=5)
    assert a == b and a != make_arithmetic_rows(300, seed=6)
    assert len({r["question"] for r in a}) == 300
    for row in a:
        result = _evaluate(row)
        assert 0 <= result <= 150
        numbers = [int(n) for n in re.findall(r"\d+", row["question"])]
        assert 1 <= len(numbers) <= 3 and max(numbers) <= 20
        # the worked line's last equation gives the final answer
        assert row["answer"].split("\n")[0].rstrip(".").endswith(str(result)) or f"= {result}" in row["answer"]


def test_arith_splits_sizes_and_disjoint():
    train, test = load_rows("arith", "train"), load_rows("arith", "test")
    assert len(train) == 2000 and len(test) == 200
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert train == load_rows("arith", "train")
    with pytest.raises(ValueError, match="splits 'train' and 'test'"):
        load_rows("arith", "validation")


def test_arith_easy_is_one_operation_on_small_numbers():
    train, test = load_rows("arith-easy", "train"), load_rows("arith-easy", "test")
    assert len(train) == 2000 and len(test) == 200
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    ops = {op for r in train for op in re.findall(r" ([-+x]) ", r["answer"])}
    assert ops == {"+", "-", "x"}
    for row in train + test:
        assert len(re.findall(r" [-+x] ", row["answer"])) == 1, row  # exactly one operation
        assert 0 <= _evaluate(row) <= 120 and max(int(n) for n in re.findall(r"\d+", row["question"])) <= 20
    with pytest.raises(ValueError, match="splits 'train' and 'test'"):
        load_rows("arith-easy", "validation")


def test_arith_unknown_kind_is_named():
    with pytest.raises(ValueError, match="unknown arithmetic problem kinds \\['div'\\]"):
        make_arithmetic_rows(5, seed=0, kinds=("add", "div"))


def test_default_instruction_has_no_single_quote():
    """tyro shell-quotes a str default in --help: a single quote inside would print as '"'"'."""
    assert "'" not in DEFAULT_INSTRUCTION and "####" in DEFAULT_INSTRUCTION


def test_arith_answers_check_with_math_reward():
    from common.rewards import math_reward

    for row in make_arithmetic_rows(50, seed=0):
        assert math_reward(row["question"], row["answer"], row["answer"]) == 1.0


# ---------------------------------------------------------------------------- build_prompts


def test_build_prompts_chat_template(tokenizer):
    rows = [{"question": "What is 2 + 3?", "answer": "#### 5"}]
    examples, n_dropped = build_prompts(rows, tokenizer)
    assert n_dropped == 0 and len(examples) == 1
    ex = examples[0]
    assert isinstance(ex, PromptExample) and ex.answer == "#### 5"
    assert ex.prompt_text.startswith("<|im_start|>")
    assert f"<|im_start|>user\nWhat is 2 + 3?\n{DEFAULT_INSTRUCTION}<|im_end|>" in ex.prompt_text
    assert ex.prompt_text.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(ex.prompt_ids) == ex.prompt_text
    assert ex.prompt_ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # system, user, assistant

    plain, _ = build_prompts(rows, tokenizer, instruction=None, chat_template=False)
    assert plain[0].prompt_text == "What is 2 + 3?"
    assert plain[0].prompt_ids == tokenizer("What is 2 + 3?")["input_ids"]


def test_build_prompts_drops_long_prompts(tokenizer):
    rows = [{"question": "Short?", "answer": "1"}, {"question": "word " * 400, "answer": "2"}, {"question": "Hi?", "answer": 3}]
    examples, n_dropped = build_prompts(rows, tokenizer, max_prompt_tokens=100)
    assert n_dropped == 1
    assert [e.answer for e in examples] == ["1", "3"]  # non-string answers become strings
    assert all(len(e.prompt_ids) <= 100 for e in examples)


def test_build_prompts_chat_rows_nested_answer_and_system_prompt(tokenizer):
    """verl's parquet rows: the prompt a chat (used as it is: no instruction), the answer nested; the system prompt
    opens a chat that has none."""
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "What is 2 + 3?"}]
    rows = [{"prompt": chat, "reward_model": {"ground_truth": "5", "style": "rule"}},
            {"prompt": [{"role": "system", "content": "Be brief."}] + chat[2:], "reward_model": {"ground_truth": 6}}]
    examples, _ = build_prompts(rows, tokenizer, "prompt", "reward_model.ground_truth", "Think.",
                                system_prompt="You add numbers.")
    want = tokenizer.apply_chat_template([{"role": "system", "content": "You add numbers."}, *chat],
                                         tokenize=False, add_generation_prompt=True)
    assert examples[0].prompt_text == want and examples[0].answer == "5" and examples[1].answer == "6"
    assert "Be brief." in examples[1].prompt_text and "You add numbers." not in examples[1].prompt_text
    assert rows[0]["prompt"][2]["content"] == "What is 2 + 3?"  # the rows are not modified
    with pytest.raises(ValueError, match=r"'reward_model.answer' is not in .*\(a.b for a nested field\)"):
        build_prompts(rows, tokenizer, "prompt", "reward_model.answer")
    with pytest.raises(ValueError, match="conversation of 3 messages, which needs a chat template"):
        build_prompts(rows, tokenizer, "prompt", "reward_model.ground_truth", chat_template=False)
    plain, _ = build_prompts(rows[1:], tokenizer, "prompt", "reward_model.ground_truth", None, chat_template=False)
    assert plain[0].prompt_text == "Be brief.\n\nWhat is 2 + 3?"


def test_build_prompts_template_variables(tokenizer):
    import copy
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}"
                         "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
                         "<assistant>{% endif %}")
    rows = [{"question": "2 + 3?", "answer": "5"}]
    no_thinking = chat_template_kwargs('{"enable_thinking": false}')
    off, _ = build_prompts(rows, tok, instruction=None, template_kwargs=no_thinking)
    on, _ = build_prompts(rows, tok, instruction=None, template_kwargs=chat_template_kwargs(""))
    assert off[0].prompt_text == "<user>2 + 3?<think></think><assistant>"
    assert on[0].prompt_text == "<user>2 + 3?<assistant>"
    for bad, what in (("enable_thinking=false", r"is not JSON \(.*\): give a JSON object of the template's"),
                      ("[1]", "is a JSON list: give an object of the template's variables")):
        with pytest.raises(ValueError, match=f"--chat-template-kwargs .* {what}"):
            chat_template_kwargs(bad)


def test_build_prompts_missing_field(tokenizer):
    rows = [{"problem": "1+1?", "solution": "2"}]
    with pytest.raises(ValueError, match=r"'question'.*\['problem', 'solution'\].*--prompt-field"):
        build_prompts(rows, tokenizer)
    with pytest.raises(ValueError, match=r"'answer'.*--answer-field"):
        build_prompts(rows, tokenizer, prompt_field="problem")
    examples, _ = build_prompts(rows, tokenizer, prompt_field="problem", answer_field="solution")
    assert examples[0].answer == "2"


# ---------------------------------------------------------------------------- PromptSampler


def _examples(n):
    return [PromptExample(prompt_ids=[i], prompt_text=f"p{i}", answer=str(i)) for i in range(n)]


def _ids(batch):
    return [e.prompt_ids[0] for e in batch]


def test_sampler_shares_disjoint_and_cover_global_batch():
    ex = _examples(20)
    single = PromptSampler(ex, batch_size=8, seed=3, rank=0, world_size=1)
    ranks = [PromptSampler(ex, batch_size=8, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(7):  # crosses epoch boundaries (2 batches of 8 per epoch of 20)
        global_batch = _ids(single.next_batch())
        shares = [_ids(s.next_batch()) for s in ranks]
        assert len(shares[0]) == len(shares[1]) == 4
        assert not set(shares[0]) & set(shares[1])
        assert shares[0] + shares[1] == global_batch
        assert len(set(global_batch)) == 8
    assert single.epoch == ranks[0].epoch == ranks[1].epoch == 3


def test_sampler_reshuffles_each_epoch():
    s = PromptSampler(_examples(16), batch_size=16, seed=0, rank=0, world_size=1)
    e0, e1 = _ids(s.next_batch()), _ids(s.next_batch())
    assert sorted(e0) == sorted(e1) == list(range(16))
    assert e0 != e1 and s.epoch == 1
    assert _ids(PromptSampler(_examples(16), 16, seed=0, rank=0, world_size=1).next_batch()) == e0


def test_sampler_resume_from_state_dict():
    ex = _examples(30)
    s = PromptSampler(ex, batch_size=6, seed=1, rank=1, world_size=2)
    for _ in range(7):
        s.next_batch()
    state = json.loads(json.dumps(s.state_dict()))  # survives a round trip through a checkpoint
    expected = [_ids(s.next_batch()) for _ in range(6)]
    resumed = PromptSampler(ex, batch_size=6, seed=1, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert [_ids(resumed.next_batch()) for _ in range(6)] == expected


def test_sampler_errors_name_the_flag():
    with pytest.raises(ValueError, match="not divisible by the number of ranks"):
        PromptSampler(_examples(10), batch_size=5, seed=0, rank=0, world_size=2)
    with pytest.raises(ValueError, match="larger than the dataset"):
        PromptSampler(_examples(4), batch_size=8, seed=0, rank=0, world_size=1)


def test_module_default_instruction():
    assert data.DEFAULT_INSTRUCTION.endswith('"#### <number>" on the last line.')
