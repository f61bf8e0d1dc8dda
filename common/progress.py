"""What a run is doing between its step lines, said on rank 0 only: one call per phase in the scripts' loops.

    show_phase(progress, step, f"generating {P} x {G}")   # the bar (tracking.Progress): "step 3: generating 4 x 8"

On a terminal the phase goes into the progress bar's description, and the HF engine adds the decoding position
("... token 17/48"), so the bar moves within a step. Without a bar (a log file, CI) the phases of the first step
are printed as lines (that step is the long one: evaluation, first generation), later ones are not.
"""
from __future__ import annotations

from transformers.generation.streamers import BaseStreamer

_active: dict = {}  # the bar and phase text the HF engine's token streamer writes into (rank 0, set by show_phase)
_first_step: list[int] = []  # the first step show_phase() saw: its phases are printed when there is no bar


def note(enabled: bool, text: str) -> None:
    """A line about a long phase before the loop (rank 0: enabled)."""
    if enabled:
        print(text + " ...", flush=True)


def show_phase(progress, step: int, text: str) -> None:
    """Say that `step` is now in phase `text` (on the bar, or as a line during the first step without one)."""
    if not progress.enabled:
        return
    bar = progress.bar if progress.bar is not None and not progress.bar.disable else None
    if bar is None:
        _first_step[:] = _first_step or [step]
        if step == _first_step[0]:
            print(f"step {step}: {text} ...", flush=True)
        return
    _active.update(bar=bar, text=f"step {step}: {text}")
    bar.set_description_str(_active["text"])


def token_streamer(max_new_tokens: int) -> BaseStreamer | None:
    """For transformers `generate(streamer=...)`: shows "token i/N" on the bar while a phase is active, else None."""
    return _TokenProgress(_active["bar"], _active["text"], max_new_tokens) if _active else None


class _TokenProgress(BaseStreamer):
    def __init__(self, bar, text: str, total: int):
        self.bar, self.text, self.total, self.calls = bar, text, total, 0

    def put(self, value) -> None:  # called once with the prompts, then once per decoding step
        if self.calls and self.calls % 4 == 0 or self.calls == 1:
            self.bar.set_description_str(f"{self.text}: token {self.calls}/{self.total}")
        self.calls += 1

    def end(self) -> None:
        self.bar.set_description_str(self.text)
