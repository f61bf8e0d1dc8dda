"""Reward functions that misbehave, for the bad-input tests."""


def sometimes_raises(prompt: str, completion: str, answer: str) -> float:
    """Raises on every other call (by completion length parity), scores 1 otherwise."""
    if len(completion) % 2:
        raise ValueError("cannot parse this completion")
    return 1.0


def always_raises(prompt: str, completion: str, answer: str) -> float:
    raise KeyError("answer")
