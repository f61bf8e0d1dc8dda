"""Environments for the multi-turn tests (--env tests.toy_env:Name)."""
from common.env import Observation

class NotAnEnv:
    """No step method: load_env refuses it."""


class Raises:
    """Raises on every other episode (by prompt length parity), else ends the episode at once: --reward-fn scores it."""

    def reset(self, example):
        return len(example.prompt_ids)

    def step(self, ids, text, n_prompt):
        if n_prompt % 2:
            raise RuntimeError("toy environment failure")
        return Observation(done=True)
