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


class EveryE:
    """Multi-turn for any model, also a random one: a model turn ends at its first 'e' (a stop string a random
    model soon writes) and a tool result is appended in-line, every turn until --max-turns; --reward-fn scores it.
    Every other result is flagged a tool error (by the turn's length parity)."""
    stop = ("e",)

    def step(self, ids, text, state):
        return Observation(text="<result>7</result>", tool_call=True, tool_error=len(text) % 2 == 1)
