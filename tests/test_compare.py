"""tools/compare.py: the figure gets the right series (mean and min/max band over seeds, x in steps or sampled
sequences), the PNG is written, and the table's columns are the differing config keys, not the always-differing ones.
The run folders are written here in the scripts' format (config.json, metrics.jsonl); test_sweep.py's real grid runs
the tool on grpo.py's own output."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from tools import compare as K


def make_run(root, name, loss_agg, seed, rewards, acc, lr=1e-6, **extra):
    run = root / name
    run.mkdir(parents=True)
    cfg = {"exp_name": name, "out_dir": str(root), "git_sha": f"sha{seed}{loss_agg}", "argv": ["grpo.py", name],
           "resumed_from": "", "model_path": f"/tmp/{name}", "seed": seed, "loss_agg": loss_agg, "lr": lr,
           "prompts_per_step": 4, "group_size": 2, "sequences_per_step": 8, "fsdp": {"offload": False}, **extra}
    (run / "config.json").write_text(json.dumps(cfg))
    rows = [{"step": s, "time": 1000.0 * seed + s, "reward/mean": r} for s, r in enumerate(rewards)]
    rows[0]["eval/accuracy"] = acc[0]
    rows.append({"step": len(rewards), "time": 5000.0 + seed, "eval/accuracy": acc[1]})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


@pytest.fixture
def sweep(tmp_path):
    make_run(tmp_path, "a1", "token-mean", 1, [0.3, 0.5, 0.9], [0.0, 0.4])  # seed 1 above seed 2
    make_run(tmp_path, "a2", "token-mean", 2, [0.1, 0.3, 0.5], [0.2, 0.6])
    make_run(tmp_path, "b1", "seq-mean-token-mean", 1, [0.2, 0.2, 0.2], [0.1, 0.1])
    make_run(tmp_path, "b2", "seq-mean-token-mean", 2, [0.4, 0.6, 0.8], [0.1, 0.3])
    return tmp_path


def curves(ax):
    return {l.get_label(): (list(l.get_xdata()), list(l.get_ydata())) for l in ax.lines}


def test_mean_and_band_over_seeds(sweep):
    fig, md = K.compare([str(sweep)], ["reward/mean", "eval/accuracy"], x="sequences")
    ax_r, ax_e = fig.axes
    assert ax_r.get_title() == "reward/mean" and ax_e.get_title() == "eval/accuracy"
    got = curves(ax_r)
    assert set(got) == {"loss_agg=token-mean (2 seeds)", "loss_agg=seq-mean-token-mean (2 seeds)"}
    xs, ys = got["loss_agg=token-mean (2 seeds)"]
    assert xs == [0, 8, 16]  # step x prompts_per_step x group_size
    np.testing.assert_allclose(ys, [0.2, 0.4, 0.7])
    band = ax_r.collections[0].get_paths()[0].vertices  # fill_between(x, min, max) of the first curve
    np.testing.assert_allclose(sorted(set(band[:, 1].round(6))), [0.1, 0.3, 0.5, 0.9])
    assert curves(ax_e)["loss_agg=seq-mean-token-mean (2 seeds)"] == ([0, 24], [0.1, 0.2])
    lines = md.splitlines()
    assert lines[0] == "| loss_agg | seeds | runs | reward/mean | eval/accuracy |"
    assert "| token-mean | 1,2 | 2 | 0.7 [0.5, 0.9] | 0.5 [0.4, 0.6] |" in lines
    assert "| seq-mean-token-mean | 1,2 | 2 | 0.5 [0.2, 0.8] | 0.2 [0.1, 0.3] |" in lines


def test_table_keys_one_run_each(tmp_path):
    """No seed axis: one curve per run, no band; nested keys are named with a dot; ignored keys never show."""
    make_run(tmp_path, "x", "token-mean", 1, [0.1, 0.2], [0.0, 0.5], lr=1e-6)
    make_run(tmp_path, "y", "token-mean", 1, [0.1, 0.4], [0.0, 0.7], lr=3e-6, fsdp={"offload": True})
    fig, md = K.compare([str(tmp_path / "x"), str(tmp_path / "y")], ["eval/accuracy"], x="step")
    header = md.splitlines()[0]
    assert header == "| fsdp.offload | lr | runs | eval/accuracy |"
    for ignored in ("exp_name", "out_dir", "git_sha", "argv", "time", "model_path", "seed"):
        assert ignored not in header
    assert curves(fig.axes[0]) == {"fsdp.offload=False, lr=1e-06": ([0, 2], [0.0, 0.5]),
                                   "fsdp.offload=True, lr=3e-06": ([0, 2], [0.0, 0.7])}
    assert not fig.axes[0].collections  # no band for single runs


def test_cli_writes_png_and_table(sweep, tmp_path):
    out = tmp_path / "figs" / "cmp.png"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "tools.compare", str(sweep / "a1"), str(sweep / "a2"), str(sweep / "b1"),
                        "--metrics", "eval/accuracy", "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 1000
    md = out.with_suffix(".md").read_text()
    assert md.splitlines()[0] == "| loss_agg | seeds | runs | eval/accuracy |" and md.strip() in p.stdout


def test_bad_input(sweep, tmp_path):
    with pytest.raises(SystemExit, match="no run logged it; the runs have: eval/accuracy, reward/mean"):
        K.compare([str(sweep)], ["eval/acc"])
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        K.compare([str(tmp_path / "nowhere")], ["reward/mean"])
    (sweep / "a1" / "config.json").write_text(json.dumps({"seed": 1, "num_steps": 3}))
    with pytest.raises(SystemExit, match="use --x step"):
        K.compare([str(sweep / "a1")], ["reward/mean"], x="sequences")


def test_a_key_older_runs_lack_is_not_a_difference():
    # the format-coef ablation (docs/results/ablation_format_coef): a run from before --fused-loss existed against one
    # that records it (False), and the one knob that was changed (format_coef): only format_coef is a column, not every
    # flag added since
    old = {"seed": 1, "format_coef": 0.1}
    new = {"seed": 1, "format_coef": 0.0, "fused_loss": False, "env": ""}
    assert K.differing_keys([old, new]) == ["format_coef"]
    assert K.differing_keys([old, new | {"fused_loss": True}, new]) == ["format_coef", "fused_loss"]


def test_labels_max_step_and_one_colour_per_curve(tmp_path):
    """Named curves, runs cut at a step (equal samples: the table's final value is the last row at or before it), and
    a curve keeps its colour in every panel even where an earlier curve has no data."""
    make_run(tmp_path, "x", "token-mean", 1, [0.1, 0.2, 0.3, 0.9], [0.0, 0.5], lr=1e-6)
    y = make_run(tmp_path, "y", "token-mean", 1, [0.1, 0.4], [0.0, 0.7], lr=3e-6)
    with open(y / "metrics.jsonl", "a") as f:  # a metric only the second run logs
        f.write(json.dumps({"step": 1, "rollout/tool_calls_mean": 0.25}) + "\n")
    fig, md = K.compare([str(tmp_path / "x"), str(y)], ["reward/mean", "rollout/tool_calls_mean"], x="step",
                        labels=["plain", "tool"], max_step=2)
    got = curves(fig.axes[0])
    assert got == {"plain": ([0, 1, 2], [0.1, 0.2, 0.3]), "tool": ([0, 1], [0.1, 0.4])}  # x's step 3 is cut
    (tool_line,) = fig.axes[1].lines
    assert tool_line.get_label() == "tool" and tool_line.get_color() == fig.axes[0].lines[1].get_color()
    assert md.splitlines()[0] == "| run | runs | reward/mean | rollout/tool_calls_mean |"
    assert "| plain | 1 | 0.3 | n/a |" in md and "| tool | 1 | 0.4 | 0.25 |" in md
    with pytest.raises(SystemExit, match=r"--labels: 1 given for 2 curves; give one per curve, in this order: lr=1e-06; "
                                         r"lr=3e-06"):
        K.compare([str(tmp_path / "x"), str(y)], ["reward/mean"], labels=["one"])
