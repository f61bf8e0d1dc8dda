"""The non-finite guard: skip an optimiser step whose loss or gradient norm is not finite on some rank, stop after
several in a row (docs/checkpoints.md, "NaN guard")."""
import math
from pathlib import Path

from common import dist as D
from common.checkpoint import latest_checkpoint


def all_finite(*values: float) -> bool:
    """True on every rank when every value is finite on every rank (an all-reduce: call it on every rank)."""
    bad = float(not all(math.isfinite(float(v)) for v in values))
    return bool(D.all_reduce(bad, op="max") == 0)


class NanGuard:
    """Skip optimiser steps whose loss or gradient norm is not finite; stop after max_consecutive in a row.

        if guard.check(grad_norm, loss, step): optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    """

    def __init__(self, max_consecutive: int = 3, ckpt_root: Path | None = None):
        self.max_consecutive, self.ckpt_root = max_consecutive, ckpt_root
        self.consecutive = 0
        self.skipped = 0  # total, for logging

    def check(self, grad_norm: float, loss: float, step: int | None = None) -> bool:
        """True: take the step. False: skip it (non-finite on some rank). Raises after max_consecutive skips."""
        if all_finite(grad_norm, loss):
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.skipped += 1
        if self.consecutive >= self.max_consecutive:
            last = latest_checkpoint(self.ckpt_root) if self.ckpt_root is not None else None
            raise RuntimeError(
                f"{self.consecutive} consecutive non-finite updates (loss {float(loss):g}, grad norm "
                f"{float(grad_norm):g}) at step {step}: stopping; lower --lr or check the data; last good "
                f"checkpoint: {last if last is not None else 'none'}")
        return False
