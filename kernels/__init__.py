"""Fused kernels. Imports neither `common` nor the scripts (see docs/architecture.md)."""

from kernels.logprob import IGNORE_INDEX, logprob_reference, token_logprobs, token_loss

__all__ = ["IGNORE_INDEX", "logprob_reference", "token_logprobs", "token_loss"]
