"""bench/floors.py: the W05 step's floors (issue 20) by hand on a small config, and the report's arithmetic."""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import floors as F
from common.flops import batch_train_flops

TINY = SimpleNamespace(hidden_size=8, num_hidden_layers=2, vocab_size=10, intermediate_size=16,
                       num_attention_heads=2, num_key_value_heads=1)


def test_generation_floor_reads_the_weights_every_step_and_each_sequence_s_cache():
    # weights per layer: q 8*8 + k, v 2*8*4 + o 8*8 = 192, MLP 3*8*16 = 384; 2 layers + head 80 = 1232 -> 2464 B
    # KV per token: 2 (K, V) * 2 layers * 1 head * 4 dims * 2 B = 32 B; 3 sequences, prompts of 5, 2 new tokens:
    # contexts 5 then 6 -> 3 * 11 * 32 = 1056 B; weights twice: 4928 B
    assert F.generation_bytes(TINY, 3, 5, 2) == 2 * 2464 + 1056


def test_floors_divide_by_the_gpu_limits():
    f = F.floors(TINY, 3, 5, 2, bandwidth=1000.0, flops=100.0)
    train = batch_train_flops(TINY, [7, 7, 7], [2, 2, 2])
    assert f == pytest.approx({"generate_s": 5.984, "ref_logp_s": train / 300, "update_s": train / 100})


def test_report_sets_each_phase_against_its_floor_and_keeps_background_generation_out_of_the_step():
    summary = {"shape": "0.5b", "runs": [
        {"name": "build", "prompts": {"prompt_tokens_mean": 256.0}},
        {"name": "grpo-a", "kind": "grpo", "script": "grpo.py", "step_s": 10.0, "generate_s": 5.0,
         "ref_logp_s": 1.0, "update_s": 3.0},
        {"name": "async-a", "kind": "grpo", "script": "grpo_async.py", "step_s": 14.0, "generate_s": 13.0,
         "ref_logp_s": 2.0, "update_s": 11.0},
        {"name": "trl-1gpu", "kind": "trl", "median_warm_s": 30.0}]}
    lines = F.report(summary, None, 4.8e12, 790e12)
    text = "\n".join(lines)
    assert "grpo-a: step 10.00 s" in text and "async-a: step 14.00 s" in text and "trl" not in text
    rest = [ln for ln in lines if "the rest" in ln]
    assert [float(ln.split()[2]) for ln in rest] == [1.0, 1.0]  # 10 - 5 - 1 - 3; 14 - 2 - 11 (generation aside)
    assert sum("in the background" in ln for ln in lines) == 1
    assert ["waiting for the background" in ln for ln in rest] == [False, True]  # grpo_async's rest holds its wait
    assert len(F.report(summary, "grpo-a", 4.8e12, 790e12)) == 6  # the header, the step, 3 phases, the rest


def test_runs_as_its_docstring_says_from_any_folder(tmp_path):
    """`python bench/floors.py SUMMARY` (the usage line), started outside the repository: it finds its imports."""
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"shape": "0.5b", "runs": [
        {"name": "build", "prompts": {"prompt_tokens_mean": 256.0}},
        {"name": "grpo-a", "kind": "grpo", "script": "grpo.py", "step_s": 10.0, "generate_s": 5.0,
         "ref_logp_s": 1.0, "update_s": 3.0}]}))
    script = Path(F.__file__).resolve()
    out = subprocess.run([sys.executable, str(script), str(summary)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "grpo-a: step 10.00 s" in out.stdout
