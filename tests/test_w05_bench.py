"""bench/w05.py's summaries (CPU): which steps count as warm, and the 1 -> N GPU scaling over interleaved rounds."""
import json

import pytest

from bench.w05 import fused_loss_lines, fused_variants, grpo_cmd, grpo_summary, pool_lines, scaling_lines, verl_cmd


def test_grpo_summary_drops_step_zero_and_the_profiled_step(tmp_path):
    rows = [{"step": s, "perf/step_s": t, "perf/generate_s": t / 2} for s, t in enumerate([30.0, 10.0, 12.0, 50.0, 11.0])]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "config.json").write_text(json.dumps({"profile_step": 3}))
    s = grpo_summary(tmp_path / "metrics.jsonl")
    assert s["warm_steps"] == [10.0, 12.0, 11.0] and s["step_s"] == 11.0 and s["generate_s"] == 5.5
    assert s["steps"] == [30.0, 10.0, 12.0, 50.0, 11.0]


def test_async_summary_drops_the_last_step_which_overlaps_nothing(tmp_path):
    """grpo_async.py's last step starts no background generation: its time is not a one-step off-policy step's."""
    rows = [{"step": s, "perf/step_s": t, "rollout/staleness": int(s > 0)} for s, t in enumerate([30.0, 7.0, 6.0, 4.0])]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    s = grpo_summary(tmp_path / "metrics.jsonl")
    assert s["warm_steps"] == [7.0, 6.0] and s["step_s"] == 6.5 and s["steps"] == [30.0, 7.0, 6.0]


def test_grpo_summary_peaks_are_maxima_over_every_step(tmp_path):
    rows = [{"step": s, "perf/step_s": 10.0, "perf/peak_mem_gib": p, "perf/trainer_peak_gib": p - 40}
            for s, p in enumerate([75.0, 73.0, 74.0])]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    s = grpo_summary(tmp_path / "metrics.jsonl")
    assert s["peak_mem_gib"] == 75.0 and s["trainer_peak_gib"] == 35.0  # step 0 counts for memory


def test_grpo_summary_reports_the_updates_health(tmp_path):
    """Gradient norm and clipped share beside the speed (warm-step medians): a run under a CUDA MPS share (one H200,
    2026-12-03) was fast with a gradient norm 3,000x the defaults' run; absent keys give None, not 0."""
    rows = [{"step": s, "perf/step_s": 7.0, "train/grad_norm": g, "train/clip_frac": c}
            for s, (g, c) in enumerate([(9.0, 0.5), (1300.0, 0.04), (1320.0, 0.05), (1290.0, 0.045)])]
    rows[0]["rollout/logprob_gap_mean"] = 0.25  # the engine's log-probs are asked for at some steps only (step 0 here)
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    s = grpo_summary(tmp_path / "metrics.jsonl")
    assert s["grad_norm"] == 1300.0 and s["clip_frac"] == 0.045  # step 0 dropped
    assert s["logprob_gap_mean"] == 0.25  # over the steps that have it, step 0 included
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "perf/step_s": 7.0}) + "\n")
    s = grpo_summary(tmp_path / "metrics.jsonl")
    assert s["grad_norm"] is None and s["clip_frac"] is None


def test_scaling_pools_rounds_and_reports_each():
    runs = [{"attn": "varlen", "nproc": 1, "round": 0, "warm_steps": [10.0, 10.0]},
            {"attn": "varlen", "nproc": 2, "round": 0, "warm_steps": [5.0, 5.0]},
            {"attn": "varlen", "nproc": 1, "round": 1, "warm_steps": [14.0, 14.0]},
            {"attn": "varlen", "nproc": 2, "round": 1, "warm_steps": [10.0, 10.0]},
            {"attn": "sdpa", "nproc": 2, "round": 0, "warm_steps": [6.0]}]  # no 1-GPU run: no line
    (line,) = scaling_lines(runs)
    # pooled: median(10, 10, 14, 14) = 12 over median(5, 5, 10, 10) = 7.5; rounds: 2.00x and 1.40x
    assert line == ("scaling varlen 1 -> 2 GPUs: 12.00 / 7.50 s = 1.60x (pooled warm steps); per round 2.00x, 1.40x; "
                    "best run each side 10.00 / 5.00 s = 2.00x")


def test_pool_keeps_each_files_rounds_apart_and_takes_phase_medians():
    run = lambda n, k, steps, gen: {"kind": "grpo", "attn": "varlen", "nproc": n, "round": k, "warm_steps": steps,
                                     "step_s": steps[0], "generate_s": gen, "update_s": 1.0}
    a = {"runs": [{"name": "build"}, run(2, 0, [5.0], 2.0), run(1, 0, [10.0], 6.0),
                  run(2, 1, [8.0], 4.0), run(1, 1, [12.0], 8.0)]}
    b = {"runs": [run(2, 0, [6.0], 3.0), run(1, 0, [9.0], 5.0), {"kind": "grpo", "nproc": 1, "warm_steps": []}]}
    scaling, one, two = pool_lines([a, b])
    # pooled: median(10, 12, 9) = 10 over median(5, 8, 6) = 6; rounds (0,0), (0,1), (1,0): 2.00x, 1.50x, 1.50x
    assert scaling == ("scaling varlen 1 -> 2 GPUs: 10.00 / 6.00 s = 1.67x (pooled warm steps); per round 2.00x, "
                       "1.50x, 1.50x; best run each side 9.00 / 5.00 s = 1.80x")
    assert one == "1 GPU(s), 3 runs, 3 warm steps: step_s 10.00 generate_s 6.00 update_s 1.00"
    assert two.startswith("2 GPU(s), 3 runs, 3 warm steps: step_s 6.00 generate_s 3.00")


def test_fused_loss_lines_compare_the_update_phase():
    run = lambda fl, upd, step, n=1: {"kind": "grpo", "attn": "varlen", "nproc": n, "fused_loss": fl, "update_s": upd,
                                      "step_s": step}
    runs = [run("on", 1.0, 5.0), run("off", 1.5, 5.5), run("on", 1.2, 5.2), run("off", 1.7, 5.6),
            run("on", 0.9, 4.0, n=2),  # no unfused 2-GPU run: no line
            {"kind": "grpo", "attn": "varlen", "nproc": 1, "fused_loss": None, "update_s": 9.0, "step_s": 9.0}]
    (line,) = fused_loss_lines(runs)
    # medians: fused update 1.1, unfused 1.6 -> 1.45x; steps 5.1 vs 5.55
    assert line == ("fused loss varlen 1 GPU(s), 2 + 2 runs: update 1.100 s fused vs 1.600 s unfused = 1.45x; "
                    "step 5.10 vs 5.55 s")


def test_pair_scan_names_the_cpu_that_slows_each_one():
    from bench.gen_scaling import print_partners
    ratios = {(i, j): 1.0 for i in range(4) for j in range(4) if i != j}
    ratios[(0, 2)], ratios[(2, 0)] = 2.0, 1.9  # 0 and 2: one host core
    lines = print_partners(ratios)
    assert lines[0] == "cpu 0: most slowed 2 x2.00; median of the others x1.00"
    assert lines[2].startswith("cpu 2: most slowed 0 x1.90") and len(lines) == 4


def test_pair_scan_measures_every_ordered_pair():
    import os
    from bench.gen_scaling import scan_pairs
    cpus = sorted(os.sched_getaffinity(0))[:2]  # CI and the GPU machine have at least two
    ratios = scan_pairs(cpus, rounds=1)
    assert set(ratios) == {(cpus[0], cpus[1]), (cpus[1], cpus[0])}
    assert all(0.2 < r < 5 for r in ratios.values())  # a time ratio, not a time or a count
    assert os.sched_getaffinity(0) >= set(cpus)  # the scan gives the process its CPUs back


def test_fused_variants_default_is_one_run_with_grpo_defaults():
    """Without --fused-loss the bench runs grpo.py once with its own default (a 7B bench run on one H200, 2026-12-02,
    died on this)."""
    assert fused_variants(None) == [None] and fused_variants("") == [None]
    assert fused_variants("off,on") == ["off", "on"]
    with pytest.raises(ValueError, match="give on, off or both"):
        fused_variants("yes")


def test_grpo_cmd_takes_the_prompts_per_step_and_puts_the_bench_flags_last(tmp_path):
    """Issue 28's W7B-8 runs 256 prompts a step on 8 GPUs; --grpo-extra comes after W05's flags (tyro: last wins)."""
    import argparse
    a = argparse.Namespace(script="grpo.py", prompts_per_step=256, num_steps=3, gpu_memory_utilization=0.3,
                           grpo_extra="--fsdp.activation-checkpointing --vllm.tensor-parallel-size 2",
                           max_tokens_per_microbatch=8192)
    cmd = grpo_cmd(a, "py", 8, "varlen", "off", tmp_path / "m", tmp_path / "p.jsonl", tmp_path, "grpo-8gpu")
    assert cmd[:5] == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8"]
    assert cmd[cmd.index("--prompts-per-step") + 1] == "256" and cmd[cmd.index("--num-steps") + 1] == "3"
    assert cmd[-6:] == ["--fsdp.activation-checkpointing", "--vllm.tensor-parallel-size", "2",
                        "--max-tokens-per-microbatch", "8192", "--no-fused-loss"]
    a.prompts_per_step, a.grpo_extra, a.max_tokens_per_microbatch = 64, "", None
    cmd = grpo_cmd(a, "py", 1, "sdpa", None, tmp_path / "m", tmp_path / "p.jsonl", tmp_path, "grpo-1gpu")
    assert cmd[cmd.index("--prompts-per-step") + 1] == "64" and cmd[-2:] == ["--exp-name", "grpo-1gpu"]


def test_verl_cmd_passes_the_site_and_the_extra_overrides_as_one_argument(tmp_path):
    """--verl-extra reaches bench/verl_w05.py --extra as one string (it splits them); none: no --extra at all."""
    import argparse
    a = argparse.Namespace(num_steps=4, timeout=590, verl_site="/tmp/verl-site",
                           verl_extra="actor_rollout_ref.model.use_fused_kernels=True a.b=1")
    cmd = verl_cmd(a, "py", tmp_path / "m", tmp_path / "p.jsonl", tmp_path)
    assert cmd[:2] == ["py", "bench/verl_w05.py"] and cmd[cmd.index("--steps") + 1] == "4"
    assert cmd[cmd.index("--timeout") + 1] == "570" and cmd[cmd.index("--out") + 1] == str(tmp_path / "verl-1gpu")
    assert cmd[-4:] == ["--site", "/tmp/verl-site", "--extra", "actor_rollout_ref.model.use_fused_kernels=True a.b=1"]
    a.verl_site, a.verl_extra = None, ""
    cmd = verl_cmd(a, "py", tmp_path / "m", tmp_path / "p.jsonl", tmp_path)
    assert "--extra" not in cmd and "--site" not in cmd
