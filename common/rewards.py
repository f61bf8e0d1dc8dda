"""Rewards: answer extraction, math / format rewards, user reward functions, and batch scoring.

A reward function is any callable

    fn(prompt: str, completion: str, answer: str) -> float

where `prompt` is the prompt text the policy saw (chat template included), `completion` the decoded
response, and `answer` the dataset's answer field as a string (for GSM8K the whole worked solution
ending in '#### <number>'). Return a finite number. Pass your own with `--reward-fn pkg.module:fn`
(imported by path; the repo root and the current folder are importable). Builtins: "math"
(math_reward) and "format" (format_reward).

score() calls the function once per sample with error accounting and an optional per-call timeout;
see its docstring for the policy.

Two ways to score a batch faster (docs/rm.md):
  - a batched function, marked with @batched (the attribute `fn.batched = True`):

        @batched
        def fn(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]: ...

    called once per batch (one value per sample, in order); its time limit is timeout x the batch size.
  - a process pool for per-sample functions: with_workers(fn, n) (--reward-workers n) scores the samples in n
    worker processes, each sample with its own timeout (SIGALRM in the worker's main thread) and its own error
    accounting, exactly as score() does serially. The function must be importable by name (a module-level def).

RunningNorm: running mean/std of rewards (--reward-norm), with state_dict() for the checkpoint.
"""

from __future__ import annotations

import importlib
import logging
import math
import multiprocessing
import numbers
import os
import pickle
import re
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

from common.errors import UsageError

RewardFn = Callable[[str, str, str], float]

# 1,234 | 1234 | -3.5 | 1/2 (comma groups only of three digits, so "3, 4" is two numbers)
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_FORMAT_RE = re.compile(r"####\s*\$?\s*" + _NUMBER)


def _clean_number(s: str) -> str:
    return s.replace(",", "").replace("$", "")


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (braces matched), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None  # unclosed


def extract_answer(text: str) -> str | None:
    """The final answer in `text`, as a string, or None.

    In order: the first number after the last '####' (or, without a number there, the rest of that
    line); else the content of the last \\boxed{...}; else the last number in the text. Numbers lose
    their thousands commas and '$' ('#### $1,234' -> '1234').
    """
    if "####" in text:
        tail = text.rsplit("####", 1)[1]
        m = _NUMBER_RE.search(tail)
        if m:
            return _clean_number(m.group())
        line = tail.strip().split("\n", 1)[0].strip()
        if line:
            return line
    boxed = _last_boxed(text)
    if boxed:
        m = _NUMBER_RE.fullmatch(boxed.replace("$", "").strip())
        return _clean_number(m.group()) if m else boxed
    numbers_found = _NUMBER_RE.findall(text)
    return _clean_number(numbers_found[-1]) if numbers_found else None


def _as_fraction(s: str) -> Fraction | None:
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _extract_gold(answer: str) -> str:
    """Gold answer: after '####' or in \\boxed{} when present (worked solutions), else the whole
    field, as MATH-style datasets store bare answers ('\\sqrt{8}', whose last number is not it)."""
    if "####" in answer or "\\boxed{" in answer:
        return extract_answer(answer) or answer.strip()
    bare = answer.strip().strip("$").strip()
    return _clean_number(bare) if _NUMBER_RE.fullmatch(bare.replace("$", "")) else bare


def math_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion's final answer equals the gold answer, else 0.0.

    The completion goes through extract_answer; the gold too when it is a worked solution ('####'
    or \\boxed{}, so GSM8K answers work), else it is used whole (bare answers like '\\frac{1}{2}').
    Exact string or exact numeric equality ('0.5' == '1/2' == '0.50') decides without math-verify;
    two numbers that differ score 0. Anything else (LaTeX, expressions) is compared with math-verify, with its own
    signal-based timeouts off so that it is safe inside score()'s timeout and off the main thread.
    """
    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    gold = _extract_gold(answer)
    if pred == gold:
        return 1.0
    pred_num, gold_num = _as_fraction(pred), _as_fraction(gold)
    if pred_num is not None and gold_num is not None:
        return float(pred_num == gold_num)

    from math_verify import parse, verify

    # math-verify wraps work in signal.alarm unless told not to; that would clobber score()'s timer.
    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    pred_parsed = parse(f"${pred}$", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return 0.0
    return float(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def format_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion's final non-empty line holds '#### <number>', else 0.0."""
    lines = [line for line in completion.splitlines() if line.strip()]
    return float(bool(lines) and _FORMAT_RE.search(lines[-1]) is not None)


class _DropTimeoutDisabledWarning(logging.Filter):
    # math-verify warns once that its timeouts are off; score() provides the timeout instead.
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


_BUILTINS: dict[str, RewardFn] = {"math": math_reward, "format": format_reward}


def load_reward_fn(spec: str) -> RewardFn:
    """"math", "format", or "pkg.module:function" (imported; the current folder is put on sys.path)."""
    if spec in _BUILTINS:
        return _BUILTINS[spec]
    if ":" not in spec:
        raise UsageError(f"--reward-fn {spec}: expected one of {sorted(_BUILTINS)} or 'pkg.module:function'")
    return import_callable(spec, "--reward-fn", "function")


def import_callable(spec: str, flag: str, kind: str):
    """The callable `attr` of module `pkg.module` for a `flag pkg.module:attr` (a function, or a class for --env); the
    current folder is put on sys.path. Each failure is a ValueError that names the flag and what to fix."""
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise UsageError(f"{flag} {spec}: cannot import module {module_name!r} ({e}); "
                             f"run from the folder that holds it or put it on PYTHONPATH") from e
        raise  # the module exists but one of its own imports failed: show that error as is
    if not hasattr(module, attr):
        raise UsageError(f"{flag} {spec}: module {module_name!r} has no attribute {attr!r} (a {kind})")
    fn = getattr(module, attr)
    if not callable(fn):
        raise UsageError(f"{flag} {spec}: {module_name}.{attr} is a {type(fn).__name__}, not callable (a {kind})")
    return fn


# ---------------------------------------------------------------------------- scoring


@dataclass
class ScoreResult:
    rewards: list[float]
    n_errors: int
    n_timeouts: int
    first_error: str | None


class RewardTimeout(BaseException):
    """Raised by the SIGALRM handler. A BaseException so that `except Exception` inside a reward
    function (math-verify has many) cannot swallow it."""


def _short(s: str, n: int = 160) -> str:
    s = str(s)
    return repr(s if len(s) <= n else s[: n // 2] + " ... " + s[-n // 2 :])


def _call_with_timeout(fn: RewardFn, args: tuple, timeout_s: float | None):
    """fn(*args), interrupted by RewardTimeout after timeout_s (main thread only, else no timeout)."""
    if not timeout_s or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        return fn(*args)

    def on_alarm(signum, frame):
        raise RewardTimeout(f"timed out after {timeout_s:g} s")

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    t0 = time.monotonic()
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:  # someone else's timer was running: give it back what is left
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - t0), 1e-3), old_interval)


def batched(fn):
    """Mark fn(prompts, completions, answers) -> list[float] as a batched reward function (score() calls it once per
    batch); usable as a decorator on a custom --reward-fn."""
    fn.batched = True
    return fn


class PooledReward:
    """A per-sample reward function scored in a pool of worker processes (--reward-workers N): score() hands it the
    batch and each worker checks and times out its samples as score() would. Calling it scores one sample here."""

    def __init__(self, fn: RewardFn, workers: int):
        if getattr(fn, "batched", False):
            raise UsageError("--reward-workers is for per-sample reward functions; a @batched function gets the "
                             "whole batch and can parallelise itself: drop --reward-workers")
        try:
            pickle.dumps(fn)
        except Exception as e:
            raise UsageError(f"--reward-workers {workers}: the reward function {fn!r} cannot be sent to a worker "
                             f"process ({type(e).__name__}: {e}); make it a module-level def") from None
        self.fn, self.workers = fn, workers
        # forkserver: workers fork from a clean server process, not from the trainer (its threads, CUDA, vLLM)
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method))
        self.__qualname__ = getattr(fn, "__qualname__", repr(fn))

    def __call__(self, prompt: str, completion: str, answer: str) -> float:
        return self.fn(prompt, completion, answer)

    def map(self, prompts, completions, answers, timeout_s):
        n = len(prompts)
        chunk = max(1, math.ceil(n / (4 * self.workers)))  # a few chunks per worker: balance without per-sample IPC
        return list(self.pool.map(_check_one, [self.fn] * n, prompts, completions, answers, [timeout_s] * n,
                                  chunksize=chunk))

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)


def with_workers(fn: RewardFn, workers: int) -> RewardFn:
    """fn itself (workers 0), or fn scored in a pool of `workers` processes (PooledReward)."""
    if workers < 0:
        raise UsageError(f"--reward-workers {workers}: must be >= 0 (0: score on the main thread)")
    return PooledReward(fn, workers) if workers else fn


def _check_one(fn: RewardFn, p: str, c: str, a: str, timeout_s: float | None) -> tuple[float, str | None, bool]:
    """One sample: (reward, None, False), or (0.0, what went wrong, whether it timed out)."""
    try:
        return _checked(_call_with_timeout(fn, (p, c, a), timeout_s))
    except RewardTimeout as e:
        return 0.0, str(e), True
    except Exception as e:
        return 0.0, f"{type(e).__name__}: {e}", False


def _checked(r) -> tuple[float, str | None, bool]:
    if not isinstance(r, numbers.Real):  # bools are fine: True -> 1.0
        return 0.0, f"returned {type(r).__name__} {_short(r, 60)}, not a number", False
    if not math.isfinite(r):
        return 0.0, f"returned non-finite {r}", False
    return float(r), None, False


def _check_batch(fn, prompts, completions, answers, timeout_s) -> list[tuple[float, str | None, bool]]:
    """A @batched function: one call for the batch (time limit timeout_s x its size); a call that raises or times
    out fails every sample, a bad value only its own."""
    n = len(prompts)
    try:
        out = _call_with_timeout(fn, (prompts, completions, answers), timeout_s * n if timeout_s else None)
    except RewardTimeout as e:
        return [(0.0, f"batched call {e} ({n} samples)", True)] * n
    except Exception as e:
        return [(0.0, f"batched call raised {type(e).__name__}: {e}", False)] * n
    if not hasattr(out, "__len__") or len(out) != n:
        raise UsageError(f"batched reward fn {getattr(fn, '__qualname__', fn)} returned "
                         f"{len(out) if hasattr(out, '__len__') else type(out).__name__} values for {n} samples; "
                         "return one number per sample, in order")
    return [_checked(r) for r in out]


def score(
    fn: RewardFn,
    prompts: list[str],
    completions: list[str],
    answers: list[str],
    timeout_s: float | None = None,
) -> ScoreResult:
    """Reward each sample with fn(prompt, completion, answer) (a @batched fn: once for the batch; a PooledReward: in
    its worker processes).

    Policy: a sample whose call raises, returns a non-number or a non-finite number, or runs past
    `timeout_s` seconds scores 0.0 and is counted (n_errors, or n_timeouts). first_error describes
    the first such sample: the error, the sample index, and shortened prompt/completion/answer.
    If EVERY sample of a non-empty batch fails (errors and timeouts together), RuntimeError is raised
    with that message: the reward function is broken, and training on all-zero rewards would waste
    the run. The timeout uses SIGALRM (signal.setitimer) and so only works on the main thread (of this process, or
    of each worker); off it, calls run without a timeout. The previous SIGALRM handler is restored after each call.
    """
    if not len(prompts) == len(completions) == len(answers):
        raise ValueError(f"score: {len(prompts)} prompts, {len(completions)} completions, {len(answers)} answers")
    if getattr(fn, "batched", False):
        outcomes = _check_batch(fn, list(prompts), list(completions), list(answers), timeout_s) if prompts else []
    elif isinstance(fn, PooledReward):
        outcomes = fn.map(prompts, completions, answers, timeout_s)
    else:
        outcomes = [_check_one(fn, p, c, a, timeout_s) for p, c, a in zip(prompts, completions, answers)]
    rewards, n_errors, n_timeouts, first_error = [], 0, 0, None
    name = getattr(fn, "__qualname__", repr(fn))
    for i, ((r, problem, timed_out), p, c, a) in enumerate(zip(outcomes, prompts, completions, answers)):
        rewards.append(r)
        if problem is None:
            continue
        n_timeouts += timed_out
        n_errors += not timed_out
        if first_error is None:
            first_error = (f"reward fn {name} failed on sample {i}: {problem}\n"
                           f"  prompt={_short(p)}\n  completion={_short(c)}\n  answer={_short(a)}")
    if rewards and n_errors + n_timeouts == len(rewards):
        raise RuntimeError(f"every one of the {len(rewards)} samples failed; first: {first_error}")
    return ScoreResult(rewards=rewards, n_errors=n_errors, n_timeouts=n_timeouts, first_error=first_error)


class RunningNorm:
    """Running mean and std of a stream of rewards (--reward-norm): each batch updates the statistics (Chan et al.'s
    parallel combination of moments), then is normalised, r' = (r - mean) / (std + eps). Every rank passes the same
    batch moments (all-reduced), so every rank holds the same statistics; state_dict() goes into the checkpoint."""

    def __init__(self, eps: float = 1e-6):
        self.eps, self.n, self.mean, self.m2 = eps, 0, 0.0, 0.0

    def update(self, n: int, mean: float, m2: float) -> None:
        """Add a batch of n values with this mean and sum of squared deviations m2."""
        if n <= 0:
            return
        total = self.n + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta ** 2 * self.n * n / total
        self.n = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.n) if self.n else 1.0

    def normalize(self, x):
        return (x - self.mean) / (self.std + self.eps)

    def state_dict(self) -> dict:
        return {"n": self.n, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.n, self.mean, self.m2 = int(state["n"]), float(state["mean"]), float(state["m2"])
