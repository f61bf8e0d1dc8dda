"""rm.py: the Bradley-Terry loss and its metrics by hand, micro-batch invariance of the gradient, a 2-rank CPU run whose
--export-hf folder scores the held-out pairs as the trainer did (transformers' own forward), exact resume and
tools/export, and the default SmolLM2 fitting the preferences of shipped HH-RLHF harmless pairs (slow)."""
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from common.packing import shard_microbatches
from common.preference import load_pair_splits
from common.reward_model import LastTokenReward, init_reward_model
from conftest import run_scripts, torchrun
from rm import Args, bradley_terry_loss, pair_losses, pair_stats, stats_metrics

ROOT = Path(__file__).resolve().parent.parent
t = lambda *x: torch.tensor(x, dtype=torch.float64)


def merged_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl rows merged by step (an evaluation is a row of its own at the step it measured)."""
    merged = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        merged.setdefault(row["step"], {}).update(row)
    return [merged[k] for k in sorted(merged)]


# ---- the loss by hand ---------------------------------------------------------------------------------------
def test_bradley_terry_by_hand():
    loss = bradley_terry_loss(t(1.0, 0.0, -2.0), t(0.0, 0.0, 1.0))
    want = [math.log(1 + math.exp(-1.0)), math.log(2), math.log(1 + math.exp(3.0))]
    assert loss.tolist() == pytest.approx(want, abs=1e-12)
    # only the difference matters: a shift of both rewards leaves the loss (and so the gradient) unchanged
    assert bradley_terry_loss(t(11.0), t(10.0)).item() == pytest.approx(want[0], abs=1e-12)
    # centering: + coef (r_c + r_r)^2
    assert bradley_terry_loss(t(11.0), t(10.0), 0.01).item() == pytest.approx(want[0] + 0.01 * 21 ** 2, abs=1e-12)
    r_c, r_r = t(0.5).requires_grad_(), t(-0.25).requires_grad_()
    bradley_terry_loss(r_c, r_r).sum().backward()  # d/dr_c = -(1 - s(r_c - r_r)) = -s(r_r - r_c)
    assert r_c.grad.item() == pytest.approx(-1 / (1 + math.exp(0.75)), abs=1e-12)
    assert r_r.grad.item() == pytest.approx(1 / (1 + math.exp(0.75)), abs=1e-12)


def test_stats_metrics_by_hand():
    r = t([1.0, 0.0], [-1.0, 2.0], [3.0, 1.0])  # accuracy 2/3
    loss = bradley_terry_loss(r[:, 0], r[:, 1])
    m = stats_metrics(pair_stats(loss, r), "eval")
    assert m["eval/accuracy"] == pytest.approx(2 / 3)
    assert m["eval/chosen_reward"] == pytest.approx(1.0) and m["eval/rejected_reward"] == pytest.approx(1.0)
    assert m["eval/margin"] == pytest.approx(0.0)
    assert m["eval/loss"] == pytest.approx(float(loss.mean()))
    assert m["eval/reward_std"] == pytest.approx(float(r.flatten().std(unbiased=False)))
    assert stats_metrics(torch.zeros(6), "eval")["eval/accuracy"] == 0.0  # no pairs: no division by zero


def test_microbatch_split_gives_same_gradient(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    args = Args(eval_fraction=0.0, eval_size=0, max_length=128)
    train, *_ = load_pair_splits(args, tok, False)
    pairs, batch = train[:6], [5, 0, 3, 1, 4, 2]
    lengths = [p.num_tokens for p in pairs]
    torch.manual_seed(0)
    model = LastTokenReward(init_reward_model(str(tiny_model_dir), tok))
    grads, losses = [], []
    for budget in (10_000, max(lengths)):
        micro = shard_microbatches(lengths, batch, 1, 0, budget)
        assert (len(micro) == 1) == (budget == 10_000)
        model.zero_grad()
        total = 0.0
        for ids in micro:
            loss, _ = pair_losses(model, pairs, ids, 0.01, torch.device("cpu"))
            (loss.sum() / len(batch)).backward()
            total += float(loss.detach().sum())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        losses.append(total)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


# ---- end to end ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_rm_two_ranks_export_scores_as_trained(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    torchrun("rm.py", "--model", str(tiny_model_dir), "--num-steps", "3", "--eval-every", "2", "--eval-size", "16",
             "--pairs-per-step", "8", "--lr", "1e-3", "--out-dir", str(out), "--export-hf", str(tmp_path / "hf"))
    rows = merged_rows(out / "rm")
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and "train/loss" not in rows[3]  # 3: the final evaluation
    for k in ("train/loss", "train/accuracy", "train/margin", "train/chosen_reward", "train/rejected_reward",
              "train/grad_norm", "eval/loss", "eval/accuracy", "eval/margin"):
        assert all(math.isfinite(r[k]) for r in rows if k in r) and (k in rows[0] or k in rows[2])
    config = json.loads((out / "rm" / "config.json").read_text())
    assert config["world_size"] == 2 and config["eval_pairs"] >= 14
    # the export, loaded by transformers alone, scores the held-out pairs as the trainer's final evaluation did
    clf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert clf.config.num_labels == 1 and clf.config.architectures == ["Qwen2ForSequenceClassification"]
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    _, evals, *_ = load_pair_splits(Args(eval_size=16), tok, False)
    with torch.no_grad():
        r = torch.tensor([[clf(input_ids=torch.tensor([p.prompt_ids + resp])).logits[0, 0].item()
                           for resp in (p.chosen_ids, p.rejected_ids)] for p in evals], dtype=torch.float64)
    final = rows[3]
    assert final["eval/chosen_reward"] == pytest.approx(float(r[:, 0].mean()), abs=1e-4)
    assert final["eval/rejected_reward"] == pytest.approx(float(r[:, 1].mean()), abs=1e-4)
    assert final["eval/accuracy"] == pytest.approx(float((r[:, 0] > r[:, 1]).double().mean()))
    assert final["eval/loss"] == pytest.approx(float(bradley_terry_loss(r[:, 0], r[:, 1]).mean()), abs=1e-4)
    assert final["eval/chosen_reward"] != pytest.approx(rows[0]["eval/chosen_reward"], abs=1e-4)  # it trained


@pytest.mark.slow
def test_rm_resume_continues_exactly(tmp_path, tiny_model_dir):
    """A run resumed from its step-1 checkpoint logs the uninterrupted run's step 1 (model, optimiser, LR schedule,
    data position)."""
    common = ["--model", str(tiny_model_dir), "--num-steps", "2", "--eval-every", "0", "--pairs-per-step", "4",
              "--lr", "1e-3", "--lr-schedule", "cosine", "--out-dir", str(tmp_path)]
    runs = run_scripts({"a": ["rm.py", *common, "--exp-name", "a", "--save-every", "1", "--export-hf",
                              str(tmp_path / "hf")],  # then b, in the same Python process
                        "b": ["rm.py", *common, "--exp-name", "b", "--resume",
                              str(tmp_path / "a" / "checkpoints" / "step_000001")],
                        # tools/export.py writes the same reward model from the final checkpoint (--key rm)
                        "tool": ["-m", "tools.export", "--checkpoint", str(tmp_path / "a" / "checkpoints" /
                                 "step_000002"), "--model", str(tiny_model_dir), "--out", str(tmp_path / "tool"),
                                 "--key", "rm"]}, tmp_path / "driver")
    for p in runs.values():
        assert p.returncode == 0, p.stderr[-3000:]
    a, b = merged_rows(tmp_path / "a"), merged_rows(tmp_path / "b")
    assert [r["step"] for r in b] == [1]
    for k in ("train/loss", "train/chosen_reward", "train/rejected_reward", "train/lr", "train/grad_norm"):
        assert b[0][k] == pytest.approx(a[1][k], rel=1e-6, abs=1e-7), k
    assert a[1]["train/loss"] != pytest.approx(a[0]["train/loss"], rel=1e-3)  # the two steps differ
    # the export of a's final checkpoint by tools/export.py (the "tool" case above)
    want, got = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "tool"))
    assert sorted(got) == sorted(want) and "score.weight" in got
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    assert json.loads((tmp_path / "tool" / "config.json").read_text())["architectures"] == \
        ["Qwen2ForSequenceClassification"]


@pytest.mark.slow
def test_rm_smollm2_learns_harmless_pairs(tmp_path):
    """The default model on the shipped pairs (data/hh-rlhf-harmless), a quarter held out (121 pairs): held-out
    accuracy above chance, and the held-out loss down by more than 0.02, after 15 steps of 8 pairs at lr 7e-5.
    --seed 1 --deterministic, one rank: the same run every time on a machine. Measured with these flags (2-core
    CPU, 2026-12-06): accuracy 0.537 -> 0.612, loss 0.705 -> 0.654 (the test's old flags, 30 steps at the default lr
    5e-5: 0.537 -> 0.603, 0.705 -> 0.662; 12 steps at 1e-4: 0.537 -> 0.603 but the loss only 0.705 -> 0.694). The
    seed also draws the score head and the batches; seed 2: 0.430 -> 0.595, loss 0.786 -> 0.695; seed 3: 0.446 ->
    0.554, loss 0.797 -> 0.721. The accuracy rose and the loss fell by more than 0.05 at all three seeds, but 0.57 is
    a bound for seed 1 (seed 3 ends below it), kept from the 30-step test."""
    out = tmp_path / "out"
    torchrun("rm.py", "--num-steps", "15", "--eval-every", "15", "--eval-fraction", "0.25", "--lr", "7e-5",
             "--seed", "1", "--deterministic", "--out-dir", str(out), nproc=1, timeout=3600)
    rows = merged_rows(out / "rm")
    first, last = rows[0], rows[-1]
    assert last["step"] == 15 and "eval/accuracy" in first
    assert last["eval/accuracy"] >= 0.57, (first["eval/accuracy"], last["eval/accuracy"])
    assert last["eval/accuracy"] > first["eval/accuracy"] and last["eval/loss"] < first["eval/loss"] - 0.02
