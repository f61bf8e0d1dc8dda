"""--max-tokens-per-microbatch 0 (auto, common/membudget.py): the sizing function, the CPU value through a real
grpo.py run, an explicit value winning, and two ranks agreeing on the minimum."""
import json
from types import SimpleNamespace

import pytest

from common.membudget import CEILING, CPU_BUDGET, activation_bytes_per_token, budget_from_memory
from conftest import run_scripts, torchrun

GiB = 2**30
QWEN05 = SimpleNamespace(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936)


def test_budget_monotone_rounded_and_clamped():
    per_tok = activation_bytes_per_token(QWEN05)
    budgets = [budget_from_memory(f * GiB, 140 * GiB, 4 * GiB, per_tok, 768)[0] for f in range(20, 141, 5)]
    assert budgets == sorted(budgets) and budgets[0] < budgets[-1]  # more free memory, never a smaller budget
    assert all(b % 1024 == 0 for b in budgets)
    assert budgets[-1] == CEILING  # a whole free H200 hits the ceiling
    assert budget_from_memory(1000 * GiB, 1000 * GiB, 0, per_tok, 768, ceiling=65536)[0] == 65536
    # within the margin: the room is only what is above max(2 GiB, 10 % of the GPU) and the reserve
    b, floored = budget_from_memory(30 * GiB, 140 * GiB, 4 * GiB, per_tok, 768)
    assert not floored and b * per_tok <= (30 - 14 - 4) * GiB < (b + 1024) * per_tok


def test_too_little_memory_gives_the_floor_and_says_so():
    per_tok = activation_bytes_per_token(QWEN05)
    assert budget_from_memory(15 * GiB, 140 * GiB, 0, per_tok, 2300) == (2300, True)  # under the 14 GiB margin
    assert budget_from_memory(0, 140 * GiB, 0, per_tok, 2300) == (2300, True)
    assert budget_from_memory(500 * GiB, 140 * GiB, 0, per_tok, 70000) == (70000, False)  # floor above ceiling


def test_per_token_estimate_follows_the_config():
    base = activation_bytes_per_token(QWEN05)
    assert activation_bytes_per_token(QWEN05, checkpointing=True) < base / 2  # checkpointing keeps layer inputs only
    assert activation_bytes_per_token(QWEN05, fused_head=False) > base + 16 * QWEN05.vocab_size  # fp32 logits
    assert activation_bytes_per_token(QWEN05, models=2) == 2 * base  # ppo.py: policy and critic
    assert activation_bytes_per_token(QWEN05, dtype_bytes=4) > base
    deeper = SimpleNamespace(**{**vars(QWEN05), "num_hidden_layers": 48})
    assert activation_bytes_per_token(deeper) > 1.9 * base
    # conservative against the H200 peaks (docs/performance.md "Micro-batch budget (auto)"): grpo_gsm8k_qwen05b at
    # 16384 tokens took 32.80 - 13.73 GiB in the update, gradients and all; the estimate alone covers it
    assert 16384 * base > (32.80 - 13.73) * GiB
    per = 16384 * base + 2 * 4 * 494e6  # + fp32 gradients and the foreach step's temporaries (update_reserve_bytes)
    assert per > (32.80 - 13.73) * GiB * 1.3
    # with checkpointing a larger budget fits the same memory
    ac = activation_bytes_per_token(QWEN05, checkpointing=True)
    assert budget_from_memory(40 * GiB, 140 * GiB, 0, ac, 768, ceiling=65536)[0] > \
        budget_from_memory(40 * GiB, 140 * GiB, 0, base, 768, ceiling=65536)[0]


def read_metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


FLAGS = {"auto": [], "explicit": ["--max-tokens-per-microbatch", "512"]}


@pytest.fixture(scope="module")
def grpo_runs(tiny_model_dir, tmp_path_factory):
    """The two grpo.py runs below, one step each on one rank, (conftest.run_scripts)."""
    out = tmp_path_factory.mktemp("membudget")
    return out, run_scripts({name: ["grpo.py", "--model", str(tiny_model_dir), "--num-steps", "1", "--prompts-per-step",
                                    "2", "--group-size", "2", "--max-new-tokens", "8", "--eval-every", "0", "--out-dir",
                                    str(out), "--exp-name", name, *flag] for name, flag in FLAGS.items()}, out / "driver")


@pytest.mark.parametrize("name", list(FLAGS))
def test_grpo_cpu_budget_in_metrics(grpo_runs, name):
    """A real grpo.py run, 1 step on CPU: auto resolves to the CPU budget, logged at step 0 and in the table; an
    explicit value is used as given and logs nothing."""
    out, results = grpo_runs
    p, flag = results[name], FLAGS[name]
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [r for r in read_metrics(out / name) if "reward/mean" in r]
    assert len(rows) == 1
    if flag:
        assert "perf/max_tokens_per_microbatch" not in rows[0]
        assert "micro-batch token budget" in p.stdout and "512" in p.stdout
    else:
        assert rows[0]["perf/max_tokens_per_microbatch"] == CPU_BUDGET
        assert "auto (resolved at the first update)" in p.stdout


@pytest.mark.slow
def test_two_ranks_take_the_minimum(tmp_path):
    out = tmp_path / "budget"
    torchrun("tests/membudget_driver.py", str(out), nproc=2)
    r0, r1 = (json.loads(open(f"{out}.{r}.json").read()) for r in (0, 1))
    assert r0["alone"] < r1["alone"]  # rank 1 was told of more memory ...
    assert r0["budget"] == r1["budget"] == r0["perf"] <= r0["alone"]  # ... and both took rank 0's (smaller) budget
    assert r0["forward"] == 4 * r0["budget"]  # --max-tokens-per-forward 0 follows the resolved budget
