"""bench/long_response.py (the single-GPU length limits of grpo.py's update) on a CPU: its smoke run writes a row per
(setting, length), counts the tokens grpo.learn_minibatch trained on, and after an out-of-memory error records it,
skips the setting's longer lengths and goes on with a model built anew."""
import json
import math
import subprocess
import sys

import pytest
import torch

from bench.long_response import is_oom, parse_args, table
from conftest import ROOT

PROMPT = 8


def test_out_of_memory_is_told_from_other_errors():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert is_oom(RuntimeError("Triton Error [CUDA]: out of memory"))
    assert not is_oom(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_oom(ValueError("out of memory"))  # not an error a device raises


def test_bad_settings_are_refused_with_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--tiny", "--fused-loss", "yes", "--out", "x.jsonl"])
    assert "--fused-loss 'yes': give on, off or on,off" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--tiny", "--device", "cuda", "--out", "x.jsonl"])


def test_table_shows_oom_and_measured_rows():
    base = {"shape": "7b", "lora_rank": 16, "activation_checkpointing": True, "fused_loss": False}
    rows = [{**base, "response_tokens": 16384, "status": "ok", "peak_allocated_gib": 61.25, "peak_reserved_gib": 70.0,
             "step_s": 7.5, "tokens_per_s": 2218.7},
            {**base, "response_tokens": 32768, "status": "oom"}]
    lines = table(rows).splitlines()
    assert lines[2] == "| 7b LoRA r=16 | 16,384 | on | off | 61.2 | 70.0 | 7.50 | 2,219 |"
    assert lines[3] == "| 7b LoRA r=16 | 32,768 | on | off | OOM |  |  |  |"


@pytest.mark.slow
def test_smoke_run_records_steps_and_recovers_from_out_of_memory(tmp_path):
    """One process, LoRA on the tiny model, all four settings; the test makes every forward of more than 24 tokens
    raise torch.OutOfMemoryError (as the caching allocator does), so each setting runs 16, fails at 24 and skips 40."""
    out = tmp_path / "long.jsonl"
    argv = ["--device", "cpu", "--tiny", "--lora-rank", "4", "--lengths", "40,16,24", "--steps", "1",
            "--prompt-tokens", str(PROMPT), "--out", str(out)]
    code = f"""
import runpy, sys, torch
from common import models
forward = models.TokenLogProbs.forward
def forward_or_oom(self, input_ids, *args, **kwargs):
    if input_ids.shape[1] > {PROMPT + 16}:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB (simulated)")
    return forward(self, input_ids, *args, **kwargs)
models.TokenLogProbs.forward = forward_or_oom
sys.argv = ["bench/long_response.py", *{argv!r}]
runpy.run_path("bench/long_response.py", run_name="__main__")
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    settings = [(c, f) for c in (False, True) for f in (False, True)]  # checkpointing off first, fused loss off first
    assert [(r["activation_checkpointing"], r["fused_loss"], r["response_tokens"]) for r in rows] == \
        [(c, f, T) for c, f in settings for T in (16, 24, 40)]  # lengths in increasing order
    assert [r["status"] for r in rows] == ["ok", "oom", "skipped"] * 4
    for r in rows:
        assert r["shape"] == "tiny" and r["lora_rank"] == 4 and r["prompt_tokens"] == PROMPT
        assert r["tokens"] == PROMPT + r["response_tokens"]
        assert math.isfinite(r["peak_rss_gib"]) and r["peak_rss_gib"] > 0
        assert r["peak_allocated_gib"] is None  # CUDA's allocator statistics only
        assert r["fused_ran"] == r["fused_loss"]  # the fused kernel ran (Triton's interpreter) exactly when asked
    assert [r["model_build"] for r in rows[0::3]] == [1, 2, 3, 4]  # built anew after each OOM (and for checkpointing)
    for r in rows[0::3]:  # measured
        assert r["trained_tokens"] == r["response_tokens"]  # every response token in grpo.py's loss, no prompt token
        assert r["step_s"] > 0 and len(r["steps_s"]) == 1
        lo, hi = r["step_s"] - 5e-5, r["step_s"] + 5e-5  # step_s is rounded to 0.1 ms, tokens_per_s to 0.1
        assert r["tokens"] / hi - 0.05 <= r["tokens_per_s"] <= r["tokens"] / lo + 0.05
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
    for r in rows[1::3]:
        assert r["why"].startswith("OutOfMemoryError: CUDA out of memory")
    for r in rows[2::3]:
        assert r["why"] == "oom at a shorter length"
    for r in rows[1::3] + rows[2::3]:
        assert r["step_s"] is None and r["trained_tokens"] is None and r.keys() == rows[0].keys()  # same columns
    assert "| tiny LoRA r=4 | 24 | off | on | OOM |" in p.stdout
