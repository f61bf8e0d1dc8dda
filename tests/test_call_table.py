"""bench/call_table.py: one device call's sub-runs side by side, ours against every TRL run of the call."""
import json
from pathlib import Path

from bench import call_table as C
from conftest import run_scripts

ROOT = Path(__file__).resolve().parents[1]


def write_call(folder: Path) -> None:
    """A call as bench/w05.py leaves it: <sub-run>/w05-0.5b/summary.json, a grpo run's metrics.jsonl beside it."""
    def summary(sub: str, runs: list[dict]) -> Path:
        d = folder / sub / "w05-0.5b"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"shape": "0.5b", "runs": [{"name": "build", "ok": True}] + runs}))
        return d

    summary("trl", [{"name": "trl-1gpu", "kind": "trl", "ok": True, "steps": [30.0, 20.0, 21.0, 22.0],
                     "median_warm_s": 21.0, "gpu_mem_peak_gib": 52.8}])
    summary("trl2", [{"name": "trl-1gpu", "kind": "trl", "ok": True, "steps": [30.0, 25.0, 24.0, 26.0],
                      "median_warm_s": 25.0, "gpu_mem_peak_gib": 52.9}])
    d = summary("fast", [{"name": "async-varlen-1gpu", "kind": "grpo", "ok": True, "step_s": 6.0,
                          "warm_steps": [5.0, 8.5, 6.0],
                          "generate_s": 4.5, "ref_logp_s": 1.5, "update_s": 3.5, "wait_rollout_s": 0.0,
                          "gpu_mem_peak_gib": 45.6, "peak_mem_gib": 23.1, "logprob_gap_mean": 0.007}])
    rows = [{"step": 0, "train/grad_norm": 99.0, "train/clip_frac": 0.5},  # step 0 is left out of the check
            {"step": 1, "train/grad_norm": 0.40, "train/clip_frac": 0.0},
            {"step": 2, "train/grad_norm": 0.42, "train/clip_frac": 0.01}]
    (d / "async-varlen-1gpu").mkdir()
    (d / "async-varlen-1gpu" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "async-varlen-1gpu" / "config.json").write_text(json.dumps({"vllm": {"num_engines": 2, "own_process": True}}))
    summary("broken", [{"name": "grpo-varlen-1gpu", "kind": "grpo", "ok": False}])
    summary("short", [{"name": "grpo-varlen-1gpu", "kind": "grpo", "ok": True, "warm_steps": []}])


def test_each_of_ours_is_set_against_every_trl_run_of_the_call(tmp_path):
    write_call(tmp_path)
    head, table = C.rows(C.load(tmp_path))
    assert head[-3:-1] == ["vs trl", "vs trl2"] and head[-1].startswith("goal (<= 6.3 s, >= 3.5x")
    by_name = {row[0]: dict(zip(head, row)) for row in table}
    fast = by_name["fast:async-varlen-1gpu"]
    # bench/w05.py's median step (6.0), its warm steps' range; each TRL run's own median over ours
    assert (fast["s/step"], fast["warm steps"], fast["vs trl"], fast["vs trl2"]) == ("6.00", "5.00-8.50", "3.50x", "4.17x")
    assert (fast["grad norm"], fast["clip max"], fast["step-0 gap"]) == ("0.400-0.420", "0.0100", "0.00700")
    assert (fast["reference"], fast["update"], fast["device GiB"], fast["trainer GiB"]) == ("1.50", "3.50", "45.6", "23.1")
    assert fast["engines"] == "2"  # as the run resolved --vllm.num-engines (its config.json)
    assert fast[head[-1]] == "met"  # 6.0 s, 3.50x and 4.17x, 45.6 GiB under both TRL runs' 52.8 and 52.9
    assert by_name["trl2"]["s/step"] == "25.00" and by_name["trl2"]["warm steps"] == "25.00 24.00 26.00"
    assert by_name["broken:grpo-varlen-1gpu"]["s/step"] == "failed"
    assert by_name["short:grpo-varlen-1gpu"]["s/step"] == "no warm step"
    assert all(len(row) == len(head) for row in table)


def test_the_command_prints_a_markdown_table_and_refuses_an_empty_folder(tmp_path):
    write_call(tmp_path / "call")
    (tmp_path / "empty").mkdir()
    runs = run_scripts({"call": ["bench/call_table.py", str(tmp_path / "call"), "--markdown"],
                        "empty": ["bench/call_table.py", str(tmp_path / "empty")]}, tmp_path / "driver")
    assert runs["call"].returncode == 0, runs["call"].stderr[-2000:]
    out = runs["call"].stdout.splitlines()
    assert out[0].startswith("| sub-run | s/step |") and out[1].startswith("|---|")
    assert any(line.startswith("| fast:async-varlen-1gpu | 6.00 |") for line in out)
    r = runs["empty"]
    assert r.returncode != 0 and "no bench/w05.py summary.json below" in r.stderr


def test_the_goal_column_names_each_part_a_run_misses():
    ratios = [21.0 / 6.3017, 25.0 / 6.3017]  # against two TRL runs of the call, whose lower device peak is 52.8
    assert C.goal(6.0, [3.5, 4.17], 45.6, 52.8) == "met"
    # just over the step (printed so that it does not read as 6.30 <= 6.3), under 3.5x one TRL run, over its memory
    assert C.goal(6.3017, ratios, 62.1, 52.8) == "6.302 s > 6.3 s; 3.332x < 3.5x; device 62.1 GiB > TRL's 52.8"
    assert C.goal(6.0, [], 45.6, 52.8) == "no TRL run in the call"  # no ratio without a peer in the same call
    assert C.goal(6.0, [3.5], None, 52.8) == "device peak not recorded"  # a missing peak is named, not passed
    assert C.goal(6.0, [3.5], 45.6, None) == "device peak not recorded"
    assert C.goal(7.0, [3.0], 45.6, 52.8, goal_step=7.5, goal_ratio=3.0) == "met"  # the thresholds are the caller's


def test_the_queue_status_orders_the_rows_and_gives_each_its_start(tmp_path):
    """With dev/gpu_queue.py's status file beside the sub-runs, rows follow the jobs' start order (not the folders'
    names) with a "start" column, so a drift of the machine's speed over the call reads down the table; a job the
    status does not name comes last, with no start."""
    write_call(tmp_path)
    (tmp_path / "status").write_text("10:00:00 start trl2 (gpu 0)\n10:04:00 end trl2 rc=0\n"
                                      "10:04:00 start fast (gpu 0)\n10:07:00 end fast rc=0\n"
                                      "10:07:00 start trl (gpu 0)\n10:09:00 start broken (gpu 0)\nqueue idle\n")
    head, table = C.rows(C.load(tmp_path))
    assert head[:3] == ["sub-run", "start", "s/step"] and all(len(row) == len(head) for row in table)
    assert [(row[0], row[1]) for row in table] == [
        ("trl2", "10:00:00"), ("fast:async-varlen-1gpu", "10:04:00"), ("trl", "10:07:00"),
        ("broken:grpo-varlen-1gpu", "10:09:00"), ("short:grpo-varlen-1gpu", "")]
    fast = dict(zip(head, table[1]))
    assert (fast["s/step"], fast["vs trl2"], fast["vs trl"], fast[head[-1]]) == ("6.00", "4.17x", "3.50x", "met")
    assert table[3][2] == "failed"


def test_the_defaults_line_sets_each_plain_grpo_run_against_the_fastest(tmp_path):
    """Issue 20's defaults goal: a grpo.py run without tuning flags (--vllm.verbose only logs; the bench's fused-loss
    variant that equals the scripts' default is no flag) against the call's fastest grpo.py run; grpo_async.py runs
    and a call without a tuned run give no line."""
    def sub(name: str, step: float, extra: str | None, script: str = "grpo.py", fused: str | None = None) -> None:
        d = tmp_path / name / "w05-0.5b"
        d.mkdir(parents=True)
        argv = ["bench/w05.py", "--nproc", "1"] + (["--grpo-extra", extra] if extra is not None else [])
        run = {"name": "grpo-varlen-1gpu", "kind": "grpo", "ok": True, "script": script, "step_s": step,
               "warm_steps": [step], "fused_loss": fused}
        (d / "summary.json").write_text(json.dumps({"argv": argv, "runs": [{"name": "build"}, run]}))

    sub("plain", 10.0, None)
    sub("verbose", 9.5, "--vllm.verbose", fused="on" if C.RLArgs.fused_loss else "off")
    assert C.defaults_check(C.load(tmp_path)) == []  # no tuned grpo.py run in the call: nothing to compare with
    sub("m4", 8.5, "--vllm.own-process --vllm.num-engines 4 --vllm.verbose")
    sub("unfused", 8.0, None, fused="off" if C.RLArgs.fused_loss else "on")  # a tuned run: the other loss path
    sub("async", 6.0, "--vllm.num-engines 2", script="grpo_async.py")  # another script: not grpo.py's best flags
    lines = C.defaults_check(C.load(tmp_path))
    assert len(lines) == 2 and all("of the fastest grpo.py run's speed (unfused:grpo-varlen-1gpu, 8.00 s," in x
                                   for x in lines)
    assert lines[0].startswith("defaults: plain:grpo-varlen-1gpu 10.00 s/step = 80% ")
    assert lines[0].endswith("under 90%")
    assert lines[1].startswith("defaults: verbose:grpo-varlen-1gpu 9.50 s/step = 84% ")
    assert C.tuning_flags(C.load(tmp_path / "m4")[0]) == ["--vllm.own-process", "--vllm.num-engines", "4"]
    sub("plain2", 8.8, None)  # 8.0 / 8.8 = 91 %
    other_loss = "--no-fused-loss" if C.RLArgs.fused_loss else "--fused-loss"
    assert C.defaults_check(C.load(tmp_path))[1].endswith(
        f"= 91% of the fastest grpo.py run's speed (unfused:grpo-varlen-1gpu, 8.00 s, {other_loss}): met 90%")
