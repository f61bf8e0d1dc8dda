"""The machinery the scripts' loops call (common/rollout.py, common/passes.py, common/perf.py, common/fsdp.py's
ShardPlan), on hand-made inputs in one process."""
import time

import pytest
import torch

from common.fsdp import ShardPlan
from common.passes import microbatch_rows
from common.perf import perf_metrics
from common.rollout import RolloutBatch, gather_rollout, padded, rollout_metrics, step_line


def batch(n_rank: int, offset: int, width: int = 4) -> RolloutBatch:
    responses = [[7] * (1 + (offset + i) % width) for i in range(n_rank)]
    return RolloutBatch([[1, 2]] * n_rank, responses, torch.arange(n_rank, dtype=torch.float32) + offset,
                        torch.ones(n_rank, dtype=torch.bool), torch.zeros(n_rank, dtype=torch.bool),
                        padded([[-0.5] * len(r) for r in responses], width),
                        padded([[1.0] * len(r) for r in responses], width).bool(), None, 1, 0, 2.0 + offset)


def test_padded():
    out = padded([[1.0, 2.0], [], [3.0]], 3)
    assert out.tolist() == [[1, 2, 0], [0, 0, 0], [3, 0, 0]]


def test_rollout_batch_derived_fields():
    b = batch(3, 0)
    assert b.lengths == [3, 4, 5]
    assert b.response_len.tolist() == [1, 2, 3]
    assert b.response_mask(4).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]


def test_gather_merges_by_field(monkeypatch):
    """Lists and tensors concatenate in rank order, counts add up, generate_s is the slowest rank's."""
    parts = [batch(2, 0), batch(3, 10)]
    monkeypatch.setattr("common.dist.all_gather_objects", lambda obj: parts)
    g = gather_rollout(parts[0])
    assert len(g.response_ids) == 5 and g.response_ids[2:] == parts[1].response_ids
    assert g.rewards.tolist() == [0, 1, 10, 11, 12]
    assert g.engine_logp.shape == (5, 4) and g.ref_logp is None
    assert torch.equal(g.engine_mask, g.engine_logp.ne(0))
    assert (g.n_errors, g.n_timeouts, g.generate_s) == (2, 0, 12.0)
    m = rollout_metrics(g)
    assert float(m["reward/mean"]) == pytest.approx(6.8) and m["reward/errors"] == 2


def test_step_line_and_perf_metrics():
    perf = {"generate_s": 2.0, "update_s": 1.0, "old_logp_s": 0.5}
    from transformers import LlamaConfig
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)
    out = perf_metrics(perf, time.perf_counter() - 4.0, cfg, [10, 20], [4, 6], [0, 1],
                       {"ref_logp": (1, False), "old_logp": (1, False), "update": (2, True)}, 2, 1e12,
                       torch.device("cpu"))
    assert out["perf/step_s"] >= 4.0 and perf["step_s"] == out["perf/step_s"]  # also written into perf
    assert out["perf/update_tokens_per_s_per_gpu"] == pytest.approx(30 * 2 / 1.0 / 2)
    assert out["perf/old_logp_tokens_per_s_per_gpu"] == pytest.approx(30 / 0.5 / 2)
    assert "perf/ref_logp_tokens_per_s_per_gpu" not in out  # not timed: not counted
    assert out["perf/generate_tokens_per_s_per_gpu"] == pytest.approx(10 / 2.0 / 2)
    # MFU: 2 fwd+bwd passes and one forward (1/3) over 1.5 s of learning phases
    fwd_bwd = out["perf/mfu"] * 1e12 * 1.5 * 2 / (30 * (2 + 1 / 3))
    assert fwd_bwd > 0
    line = step_line(3, {"reward/mean": 0.5, "reward/correct_frac": 0.25, "rollout/response_len_mean": 5.0,
                         "train/loss": -0.1, "perf/step_s": 4.2})
    assert line.startswith("step    3 | reward 0.500") and "4.2 s/step" in line


def test_trainer_peak_leaves_out_the_engine_pool(monkeypatch):
    """With a vLLM engine in the process, torch's peak counter holds the engine's pool too (also asleep): perf/ keeps
    that raw peak and adds the trainer's own (a 7B run on one H200, 2026-12-02: 73.4 GiB counted, ~40 GiB of it the
    engine's)."""
    import common.perf as P
    import common.tracking as T
    from transformers import LlamaConfig
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)
    monkeypatch.setattr(P, "step_peak_gib", lambda: 73.4)
    monkeypatch.setattr(T, "_engine_pool", 0)
    args = ({"update_s": 1.0}, time.perf_counter(), cfg, [10], [4], [0], {"update": (1, True)}, 1, 1e12,
            torch.device("cuda"))
    out = perf_metrics(*args)  # no engine (HF rollouts, or before one is built): the raw peak only
    assert out["perf/peak_mem_gib"] == 73.4 and "perf/trainer_peak_gib" not in out
    T.count_engine_pool(40 * 2**30)
    T.count_engine_pool(-5)  # a negative delta (the trainer freed memory meanwhile) counts as nothing
    out = perf_metrics({"update_s": 1.0}, *args[1:])
    assert out["perf/engine_pool_gib"] == 40.0 and out["perf/trainer_peak_gib"] == pytest.approx(33.4)
    assert out["perf/peak_mem_gib"] == 73.4


class FakeFSDP:
    def __init__(self):
        self.calls = []

    def set_requires_gradient_sync(self, on):
        self.calls.append(("sync", on))

    def set_reshard_after_backward(self, on):
        self.calls.append(("reshard", on))


@pytest.mark.parametrize("keep", [False, True])
def test_microbatch_rows_choreography(keep):
    """Every rank gets the same number of micro-batches (padding ones empty); gradients are reduced, and with
    keep_gathered the parameters resharded, only after the last."""
    lengths = [30, 20, 5, 5, 5]
    plan = ShardPlan("model", keep, torch.float32)
    per_rank = []
    for rank in range(2):
        m = FakeFSDP()
        per_rank.append((list(microbatch_rows([(m, plan)], lengths, list(range(5)), 2, rank, 30)), m.calls))
    (rows0, calls0), (rows1, calls1) = per_rank
    assert len(rows0) == len(rows1) >= 2
    assert sorted(r for mb in rows0 + rows1 for r in mb) == list(range(5))
    assert [] in rows0 + rows1  # a padding micro-batch on the lighter rank
    n = len(rows0)
    assert [on for k, on in calls0 if k == "sync"] == [False] * (n - 1) + [True]
    assert [on for k, on in calls0 if k == "reshard"] == ([False] * (n - 1) if keep else [True] * (n - 1)) + [True]


def test_shard_plan_table():
    rows = ShardPlan("layer", False, torch.bfloat16).table()
    assert rows["FSDP unit"] == "layer" and rows["FSDP compute dtype"] == "bfloat16"
    assert "sum over ranks" in rows["gradient reduction"]


@pytest.mark.slow
def test_copy_params_fills_a_frozen_bf16_copy_across_ranks(tiny_model_dir, tmp_path):
    """common.fsdp.copy_params on 2 ranks: after it, the frozen bf16 copy's full tensors are exactly the policy's
    cast to bf16, whether the policy's parameters were resharded or left gathered by a forward (tests/
    copy_params_driver.py); the copy stays sharded."""
    from conftest import torchrun
    out = tmp_path / "res.pt"
    torchrun("tests/copy_params_driver.py", str(tiny_model_dir), str(out), nproc=2, timeout=600)
    res = torch.load(out)
    assert res["before"] > 0  # the copy differed before (the policy had taken an optimiser step)
    assert res["resharded"] == 0
    assert res["policy_gathered"] and res["zeroed"] > 0 and res["gathered"] == 0  # from gathered parameters too
    assert res["dtypes"] == ["torch.bfloat16"] and res["sharded"]
