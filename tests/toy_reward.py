"""A toy reward for learning tests: a random tiny model can improve it within a few GRPO steps.

Used as `--reward-fn tests.toy_reward:letters` (also an example of a custom reward function)."""


def letters(prompt: str, completion: str, answer: str) -> float:
    """Fraction of the completion's characters that are ASCII letters (0 for an empty completion)."""
    return sum(c.isascii() and c.isalpha() for c in completion) / max(1, len(completion))
