"""A toy reward for learning tests: a random tiny model can improve it within a few GRPO steps.

Used as `--reward-fn tests.toy_reward:letters` (also an example of a custom reward function)."""


def letters(prompt: str, completion: str, answer: str) -> float:
    """Fraction of the completion's characters that are ASCII letters (0 for an empty completion)."""
    return sum(c.isascii() and c.isalpha() for c in completion) / max(1, len(completion))


def a_to_m(prompt: str, completion: str, answer: str) -> float:
    """Fraction of the completion's characters that are the letters a-m, either case (0 for an empty completion).
    The learning tests use it: a random policy over SmolLM2's mostly-letter vocabulary already scores 0.88 on
    letters() but about 0.47 here, which leaves room to rise."""
    return sum(c.isascii() and c.isalpha() and c.lower() <= "m" for c in completion) / max(1, len(completion))
