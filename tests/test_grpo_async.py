"""grpo_async.py (issue 20: one-step off-policy rollouts) on CPU with the HF engine: --no-async-rollout is grpo.py
exactly; with it on, step t's rollout is the one the weights of one refit ago generated, pi_old in the ratio is the
engine's (behaviour) log-prob, rollout/staleness is logged, and a 3-step run stays finite."""
import json
import math
import sys

import pytest
import torch

import grpo_async
from conftest import ROOT, recipe_flags, run_scripts

# a tiny deterministic CPU run; one mini-batch, so grpo.py's pi_old is pi.detach() (ratio 1, clip fraction 0)
TINY = ["--num-steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "8",
        "--eval-every", "0", "--log-samples-every", "1", "--reward-fn", "tests.toy_reward:letters", "--lr", "1e-2",
        "--seed", "1", "--deterministic", "--device", "cpu", "--rollout", "hf", "--logprob-impl", "torch",
        "--temperature", "1.0", "--top-k", "0", "--top-p", "1.0", "--num-minibatches", "1", "--num-epochs", "1",
        "--engine-logprobs-every", "1"]


def read_run(out, name):
    """A run's metrics rows (of the steps that trained) and its samples by step."""
    rows = [json.loads(line) for line in open(out / name / "metrics.jsonl")]
    samples = {}
    for line in open(out / name / "samples.jsonl"):
        r = json.loads(line)
        samples.setdefault(r["step"], []).append((r["prompt"], r["completion"], r["reward"]))
    return [r for r in rows if "reward/mean" in r], samples


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """The runs the slow tests read, each on one rank with TINY and its own flags (later flags win), each a process
    forked by conftest.run_scripts: grpo.py; grpo_async.py off; on for 3 steps; off for 3 steps at lr 0 (its
    weights stay those of step 0 at every step); on for 3 steps, the engine in the trainer's process (a thread);
    on for 3 steps with the defaults: the engine in a process of its own (step 1 profiled); with pi_old scored by the
    trainer (--behaviour-logp trainer); on for 3 steps with two engine processes (--vllm.num-engines 2)."""
    out = tmp_path_factory.mktemp("async")
    cases = {"grpo": ("grpo.py",), "off": ("grpo_async.py", "--no-async-rollout"),
             "on": ("grpo_async.py", "--num-steps", "3", "--vllm.no-own-process"),
             "frozen": ("grpo_async.py", "--no-async-rollout", "--lr", "0", "--num-steps", "3"),
             "process": ("grpo_async.py", "--num-steps", "3", "--profile-step", "1"),  # the default
             "trainer": ("grpo_async.py", "--num-steps", "3", "--behaviour-logp", "trainer", "--vllm.no-own-process"),
             "engines2": ("grpo_async.py", "--num-steps", "3", "--vllm.num-engines", "2")}
    results = run_scripts({name: [script, "--model", str(tiny_model_dir), *TINY, *extra, "--out-dir", str(out),
                                  "--exp-name", name] for name, (script, *extra) in cases.items()}, out / "driver")
    for name, p in results.items():
        assert p.returncode == 0, f"{name}: {p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return {name: read_run(out, name) for name in cases} | {"dir": out}


@pytest.mark.slow
def test_off_is_grpo(runs):
    """--no-async-rollout logs what grpo.py logs, bit for bit, timings aside; the same samples."""
    (grpo, grpo_samples), (off, off_samples) = runs["grpo"], runs["off"]
    assert [r["step"] for r in off] == [0, 1]
    for a, b in zip(grpo, off):
        keys = {k for k in a if not k.startswith("perf/") and k != "time"}
        assert keys == {k for k in b if not k.startswith("perf/") and k != "time"}
        assert "rollout/staleness" not in keys and "rollout/logprob_gap_mean" in keys
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert grpo_samples == off_samples


@pytest.mark.slow
def test_async_rollout_comes_from_the_weights_of_one_refit_ago(runs):
    """Step 0 generates now (the first step has no previous rollout); step 1 learns from the rollout the step-0
    weights generated while step 0 learned: it equals the frozen run's (weights of step 0 at every step) and not
    grpo.py's step 1 (the weights after step 0's update, which sample differently)."""
    (on, on_samples), (_, grpo_samples), (_, frozen_samples) = runs["on"], runs["grpo"], runs["frozen"]
    assert [r["step"] for r in on] == [0, 1, 2]
    assert [r["rollout/staleness"] for r in on] == [0, 1, 1]
    assert on_samples[0] == grpo_samples[0]  # the first step: generated now, by the same weights and seed
    assert on_samples[1] == frozen_samples[1]  # the step-0 weights' rollout, learned from at step 1
    assert on_samples[1] != grpo_samples[1]  # the test can tell: the updated weights sample other completions
    assert on_samples[2] != frozen_samples[2]  # step 2's: by the weights refit after step 0's update, not step 0's
    # the overlap is timed: step t waited for step t+1's generation (wait_rollout_s) before refitting, except the last
    assert [("perf/wait_rollout_s" in r) for r in on] == [True, True, False]
    assert all(r["perf/generate_s"] > 0 for r in on)


@pytest.mark.slow
def test_the_engine_in_a_process_of_its_own_changes_nothing_but_where_it_runs(runs):
    """--vllm.own-process (common/engine_process.py): the same async run, its engine in a child process refit with
    CPU copies of the weights, logs the same metrics and samples bit for bit, timings aside. --profile-step 1 (on in
    that run) also has the child profile the background generation that runs beside step 1's learning phases."""
    (on, on_samples), (proc, proc_samples) = runs["on"], runs["process"]
    assert [r["step"] for r in proc] == [0, 1, 2] and proc_samples == on_samples
    for a, b in zip(on, proc):
        keys = {k for k in a if not k.startswith("perf/") and k != "time"}
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys if k in keys}
    run_dir = runs["dir"] / "process"
    assert "aten::" in (run_dir / "profile_step1_generate_engine.txt").read_text()  # the child's own ops
    assert (run_dir / "profile_step1.txt").is_file() and not (run_dir / "profile_step0_generate_engine.txt").exists()


@pytest.mark.slow
def test_two_engine_processes_sample_the_same_prompts_and_train(runs):
    """--vllm.num-engines 2: each child samples half of a step's prompts (the HF engine draws the second half from a
    stream of its own, so completions differ from one engine's), the rollout keeps the prompts' order and size, and
    training runs as with one engine: step 0 (same weights) clips nothing, the next steps (one update behind) do."""
    (one, one_samples), (two, two_samples) = runs["process"], runs["engines2"]
    assert [r["step"] for r in two] == [0, 1, 2]
    for step in (0, 1, 2):
        assert [p for p, _, _ in two_samples[step]] == [p for p, _, _ in one_samples[step]]
    assert two_samples[0] != one_samples[0]  # the second share's completions come from another stream
    assert two[0]["train/clip_frac"] == 0 and two[1]["train/clip_frac"] > 0
    for r in two:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, (int, float))), r
        assert r["rollout/sequences_trained"] == 8 and r["perf/generate_s"] > 0


@pytest.mark.slow
def test_behaviour_log_probs_scored_by_the_trainer_are_the_engine_s(runs):
    """--behaviour-logp trainer: a frozen copy of the policy one refit behind scores pi_old instead of the engine.
    The HF engine's log-probs are fp32 computations of the same weights, so the two runs must agree to float error:
    the same samples (steps 0-2), losses and clip fractions. A copy holding the trainer's current weights would give
    ratio 1 (clip fraction 0 at steps 1-2, as grpo.py), one lagging two refits other losses. The engine is asked for
    log-probs only at the synchronous step 0 (the logprob gap is logged there: engine vs trainer, same weights)."""
    (on, on_samples), (tr, tr_samples) = runs["on"], runs["trainer"]
    assert [r["step"] for r in tr] == [0, 1, 2] and [r["rollout/staleness"] for r in tr] == [0, 1, 1]
    assert tr_samples[0] == on_samples[0] and tr_samples[1] == on_samples[1]
    assert tr[1]["train/clip_frac"] > 0 and tr[2]["train/clip_frac"] > 0
    for a, b in zip(on, tr):
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-4)
        assert b["train/clip_frac"] == pytest.approx(a["train/clip_frac"], abs=0.02)
    assert tr[0]["rollout/logprob_gap_mean"] < 1e-4 and "rollout/logprob_gap_mean" not in tr[1]
    assert "perf/old_logp_s" in tr[1]  # the behaviour pass, timed as pi_old's pass


@pytest.mark.slow
def test_async_pi_old_is_the_behaviour_policy_and_the_run_is_sane(runs):
    """With one optimiser step per rollout grpo.py's ratio is exactly 1 (pi_old = pi.detach(): nothing clipped).
    grpo_async.py divides by the engine's log-probs from step 1: there the trainer is one update (lr 1e-2) past the
    weights that sampled, so some tokens' ratios leave [0.8, 1.2] and are clipped. Step 0 is generated now by the
    trainer's weights: pi_old is the trainer's own, as in grpo.py, and the engine's distance from it is logged (the HF
    engine: the same fp32 model, so ~0; a CUDA MPS share's fault, one H200, 2026-12-03, showed at this step as clipped
    tokens and a 3,000x gradient norm, with no gap metric). All metrics are finite."""
    on, _ = runs["on"]
    grpo, _ = runs["grpo"]
    assert all(r["train/clip_frac"] == 0 for r in grpo)
    assert on[0]["train/clip_frac"] == 0
    assert on[1]["train/clip_frac"] > 0 and on[2]["train/clip_frac"] > 0
    assert "rollout/logprob_gap_mean" not in on[1]  # 0 by construction with pi_old = the engine's log-probs
    assert on[0]["rollout/logprob_gap_max"] < 1e-3 and on[0]["rollout/logprob_gap_mean"] < 1e-4
    for r in on:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, (int, float))), r
        assert r["train/grad_norm"] > 0 and r["train/entropy"] > 0 and r["rollout/sequences_trained"] == 8


def test_ratio_divides_by_the_behaviour_log_probs():
    """The ratio pi / pi_old with pi_old = the behaviour (engine) log-probs, as main passes it with --async-rollout:
    hand-computed on two tokens. Token 0: pi 0.5, behaviour 0.25 -> ratio 2, clipped to 1.2 (A = +1); token 1: pi
    0.3, behaviour 0.3 -> ratio 1. Had the trainer's own log-prob been pi_old, both ratios would be 1 (loss -1)."""
    args = grpo_async.Args()
    assert args.async_rollout and not args.recompute_old_logp  # the default: no trainer pass for pi_old
    assert args.vllm.own_process and not grpo_async.Args(vllm=grpo_async.VLLMArgs()).vllm.own_process  # grpo.py's off
    assert grpo_async.Args(num_minibatches=2).recompute_old_logp is False  # even with 2 optimiser steps a rollout
    assert grpo_async.Args(num_minibatches=2, async_rollout=False).recompute_old_logp  # grpo.py's rule when off
    logp = torch.log(torch.tensor([[0.5, 0.3]])).requires_grad_()  # (1, 2) the trainer's pi
    behaviour = torch.log(torch.tensor([[0.25, 0.3]]))  # (1, 2) the engine's log-probs of the sampled tokens
    mask, adv = torch.ones(1, 2), torch.ones(1)
    loss, stats = grpo_async.policy_loss(logp, torch.zeros(1, 2), mask, adv, behaviour, None, behaviour, args, 2.0)
    assert float(loss.detach()) == pytest.approx(-(1.2 + 1.0) / 2)
    assert float(stats["clip_frac"]) == 1 and float(stats["gap_sum"]) == 0
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] == pytest.approx(-0.5)  # clipped: no gradient; else -A r / 2
    on_policy, _ = grpo_async.policy_loss(logp, torch.zeros(1, 2), mask, adv, logp.detach(), None, behaviour, args,
                                          2.0)
    assert float(on_policy.detach()) == pytest.approx(-1.0)


REFUSED = {"tis": ["--tis-cap", "2"], "dynamic": ["--dynamic-sampling", "--dynamic-sampling-max-rounds", "2"]}


@pytest.fixture(scope="module")
def refusals(tiny_model_dir, tmp_path_factory):
    """grpo_async.py's command lines that must stop at its flag checks, (conftest.run_scripts): each flag it refuses
    with --async-rollout (REFUSED), and the async recipe's whole command line with a model file that does not exist."""
    out = tmp_path_factory.mktemp("refusals")
    argv = (recipe_flags("grpo_gsm8k_qwen05b.sh", '"${SCRIPT:-grpo.py}" \\\n')
            + recipe_flags("grpo_async_gsm8k_qwen05b.sh", "exec bash runs/grpo_gsm8k_qwen05b.sh"))
    argv = [str(out / "no-such-model.gguf") if a == "$MODEL" else str(out / "data") if a == "$DATA" else
            str(out / "out") if a == "$OUT_DIR" else a for a in argv]
    cases = {name: ["grpo_async.py", "--model", str(tiny_model_dir), *TINY, *flag, "--out-dir", str(out / name)]
             for name, flag in REFUSED.items()} | {"recipe": ["grpo_async.py", *argv]}
    return run_scripts(cases, out / "driver")


@pytest.mark.parametrize("name", list(REFUSED))
def test_async_rejects_flags_it_cannot_honour(refusals, name):
    p, flag = refusals[name], REFUSED[name]
    assert p.returncode != 0
    assert "--async-rollout takes no" in p.stderr and flag[-2] in p.stderr and "--no-async-rollout" in p.stderr


def test_recipe_is_the_synchronous_recipe_with_the_script_swapped(monkeypatch):
    """runs/grpo_async_gsm8k_qwen05b.sh (a GPU recipe, not run on CPU) parses, turns the async mode on, and sets every
    flag as runs/grpo_gsm8k_qwen05b.sh does for grpo.py but --tis-cap (refused in async mode) and where the engines run
    (grpo_async.py's default: one in a process of its own; grpo.py's: the automatic count), so the two runs compare one
    to one (a request's samples do not depend on how many engines share the batch)."""
    import dataclasses
    import grpo
    from common.args import cli

    def parsed(script, argv):
        monkeypatch.setattr(sys, "argv", [f"{script.__name__}.py", *argv])
        return dataclasses.asdict(cli(script.Args))

    base = recipe_flags("grpo_gsm8k_qwen05b.sh", '"${SCRIPT:-grpo.py}" \\\n')  # the synchronous recipe's grpo.py flags
    assert "SCRIPT=grpo_async.py " in (ROOT / "runs" / "grpo_async_gsm8k_qwen05b.sh").read_text()
    sync = parsed(grpo, base)
    async_ = parsed(grpo_async,
                    base + recipe_flags("grpo_async_gsm8k_qwen05b.sh", "exec bash runs/grpo_gsm8k_qwen05b.sh"))
    assert async_.pop("async_rollout") is True and async_.pop("behaviour_logp") == "engine"
    assert (sync.pop("exp_name"), async_.pop("exp_name")) == ("grpo_gsm8k_qwen05b", "grpo_async_gsm8k_qwen05b")
    assert (sync.pop("tis_cap"), async_.pop("tis_cap")) == (2.0, 0.0)  # TIS is refused with --async-rollout
    assert (sync["vllm"].pop("own_process"), async_["vllm"].pop("own_process")) == (False, True)  # the script's default
    assert (sync["vllm"].pop("num_engines"), async_["vllm"].pop("num_engines")) == (0, 1)  # grpo.py's: auto
    assert async_ == sync
    assert (sync["rollout"], sync["num_steps"], sync["vllm"]["sleep_level"]) == ("vllm", 100, 0)


def test_the_async_recipes_flags_pass_the_scripts_checks(refusals):
    """The recipe's whole command line (the synchronous recipe's flags + its own) gets past grpo_async.py's flag checks
    and stops only at the model file, which does not exist here (a recipe flag the script refuses would stop it
    first: the synchronous recipe's --tis-cap 2.0, which --async-rollout refuses, once did)."""
    p = refusals["recipe"]  # the command line: the fixture's
    assert p.returncode != 0
    assert "--async-rollout takes no" not in p.stderr, p.stderr[-2000:]
    assert "no-such-model.gguf" in p.stderr, p.stderr[-2000:]


def test_the_behaviour_copy_is_made_only_for_async_runs_and_refused_with_lora():
    """--behaviour-logp trainer: a copy only with --async-rollout (grpo.py's pi_old otherwise: none needed), never by
    default, and not with LoRA (it would copy the whole policy beside the frozen base the adapters share)."""
    from dataclasses import replace

    from common.rl_setup import BehaviourPolicy
    cpu = torch.device("cpu")
    assert BehaviourPolicy.make(grpo_async.Args(), "no-model", cpu) is None  # engine: the default
    assert BehaviourPolicy.make(grpo_async.Args(behaviour_logp="trainer", async_rollout=False), "no-model", cpu) is None
    lora_args = grpo_async.Args(behaviour_logp="trainer")
    lora_args.lora = replace(lora_args.lora, rank=4)
    with pytest.raises(ValueError, match="not with LoRA"):
        BehaviourPolicy.make(lora_args, "no-model", cpu)
