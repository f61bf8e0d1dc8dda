import json
import signal
import threading
import time
from pathlib import Path

import pytest

from common.data import load_rows
from common.rewards import (
    extract_answer,
    format_reward,
    load_reward_fn,
    math_reward,
    score,
)

GSM8K_TEST = Path(__file__).resolve().parent / "data" / "gsm8k" / "test.jsonl"  # 50 rows, MIT (tests/data)
GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the total is\n#### 1,234", "1234"),
        ("#### $-3.50", "-3.50"),
        ("#### 5 apples", "5"),
        ("first 3 then #### 4 and #### 9", "9"),  # the last '####' wins
        ("\\boxed{7}", "7"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last box, nested braces
        ("the answer is 12.", "12"),
        ("3, 4 and 1,000,000", "1000000"),
        ("no answer here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("#### 72", GSM8K_SOLUTION, 1.0),  # gold is a GSM8K worked solution
        ("They sold 72 clips.", GSM8K_SOLUTION, 1.0),
        ("#### 71", GSM8K_SOLUTION, 0.0),
        ("#### 0.5", "1/2", 1.0),  # numeric shortcut
        ("#### 18.00", "18", 1.0),
        ("#### 1,234", "$1234$", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # math-verify
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),  # math-verify, bare LaTeX gold
        ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
        ("I don't know", "5", 0.0),
    ],
)
def test_math_reward(completion, answer, expected):
    assert math_reward("prompt", completion, answer) == expected


def test_math_reward_inside_our_timeout_and_off_main_thread():
    # math-verify's own signal timeouts are off: works off the main thread and under score()'s timer
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("", "\\boxed{\\frac{1}{2}}", "0.5")))
    t.start()
    t.join()
    assert out == [1.0]
    r = score(math_reward, ["p"] * 2, ["\\boxed{\\frac{1}{2}}", "#### 3"], ["0.5", "4"], timeout_s=5.0)
    assert r.rewards == [1.0, 0.0] and r.n_errors == 0 and r.n_timeouts == 0


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("Step 1.\n#### 18", 1.0),
        ("Step 1.\n#### $1,234.5\n\n  \n", 1.0),  # trailing blank lines ignored
        ("#### 18\nand some more text", 0.0),  # not on the final line
        ("The answer is 18", 0.0),
        ("#### eighteen", 0.0),
        ("", 0.0),
    ],
)
def test_format_reward(completion, expected):
    assert format_reward("p", completion, "18") == expected


def test_load_reward_fn_builtin_and_custom(tmp_path, monkeypatch):
    assert load_reward_fn("math") is math_reward
    assert load_reward_fn("format") is format_reward
    pkg = tmp_path / "myrewards_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("def length_fn(prompt, completion, answer):\n    return float(len(completion))\nX = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_fn("myrewards_pkg.mod:length_fn")
    assert fn("p", "abc", "a") == 3.0

    with pytest.raises(ValueError, match="module 'myrewards_pkg.mod' has no attribute 'nope'"):
        load_reward_fn("myrewards_pkg.mod:nope")
    with pytest.raises(ValueError, match="not callable"):
        load_reward_fn("myrewards_pkg.mod:X")
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg_xyz.mod'"):
        load_reward_fn("no_such_pkg_xyz.mod:fn")
    with pytest.raises(ValueError, match="pkg.module:function"):
        load_reward_fn("not_a_builtin")


def test_score_counts_errors_and_reports_sample():
    def fn(prompt, completion, answer):
        if answer == "boom":
            raise KeyError("missing key")
        if answer == "nan":
            return float("nan")
        if answer == "str":
            return "1.0"
        return 1.0

    answers = ["ok", "boom", "nan", "str", "ok"]
    r = score(fn, [f"prompt {i}" for i in range(5)], ["c"] * 5, answers)
    assert r.rewards == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert r.n_errors == 3 and r.n_timeouts == 0
    assert "KeyError" in r.first_error and "sample 1" in r.first_error
    assert "prompt 1" in r.first_error and "boom" in r.first_error


def test_score_all_errors_raises():
    def broken(prompt, completion, answer):
        return 1 / 0

    with pytest.raises(RuntimeError, match="sample 0: ZeroDivisionError"):
        score(broken, ["p", "q"], ["c", "d"], ["a", "b"])
    assert score(broken, [], [], []).rewards == []


def test_score_timeout_cuts_hanging_call_and_restores_handler():
    def handler(signum, frame):
        pass

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        def fn(prompt, completion, answer):
            if answer == "hang":
                time.sleep(10)
            return 0.5

        t0 = time.monotonic()
        r = score(fn, ["p"] * 3, ["c"] * 3, ["ok", "hang", "ok"], timeout_s=0.2)
        assert time.monotonic() - t0 < 2.0
        assert r.rewards == [0.5, 0.0, 0.5]
        assert r.n_timeouts == 1 and r.n_errors == 0
        assert "timed out" in r.first_error and "sample 1" in r.first_error
        assert signal.getsignal(signal.SIGALRM) is handler
        assert signal.getitimer(signal.ITIMER_REAL)[0] == 0.0
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_score_timeout_not_swallowed_by_except_exception():
    def fn(prompt, completion, answer):
        try:
            time.sleep(10)
        except Exception:
            return 1.0
        return 1.0

    t0 = time.monotonic()
    r = score(lambda p, c, a: fn(p, c, a) if a == "hang" else 1.0, ["p"] * 2, ["c"] * 2, ["hang", "ok"], timeout_s=0.2)
    assert time.monotonic() - t0 < 2.0
    assert r.rewards == [0.0, 1.0] and r.n_timeouts == 1


def test_gsm8k_gold_solutions_score_one():
    rows = load_rows(str(GSM8K_TEST), "test")[:50]
    assert len(rows) == 50
    for row in rows:
        assert math_reward(row["question"], row["answer"], row["answer"]) == 1.0
        final = row["answer"].rsplit("####", 1)[1].strip()
        assert math_reward(row["question"], f"Reasoning...\n#### {final}", row["answer"]) == 1.0
        assert format_reward(row["question"], row["answer"], row["answer"]) == 1.0
    json.dumps(rows[0])  # plain dicts
