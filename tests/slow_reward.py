"""Reward functions for the worker-pool and batched-reward tests (importable by name, as --reward-fn needs)."""
import os
import time

from common.rewards import batched, math_reward


def sleepy(prompt: str, completion: str, answer: str) -> float:
    """Hangs on completions containing 'hang', raises on 'boom', returns NaN on 'nan', else the math reward."""
    if "hang" in completion:
        time.sleep(60)
    if "boom" in completion:
        raise ValueError(f"cannot score {completion!r}")
    if "nan" in completion:
        return float("nan")
    return math_reward(prompt, completion, answer)


def worker_pid(prompt: str, completion: str, answer: str) -> float:
    return float(os.getpid())


@batched
def lengths(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """A batched reward: the completion's length, 'x' for a non-number."""
    return [float(len(c)) if c != "bad" else "x" for c in completions]


@batched
def wrong_count(prompts, completions, answers):
    return [1.0]


@batched
def slow_batch(prompts, completions, answers):
    time.sleep(60)
