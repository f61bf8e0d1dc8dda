"""bench/trl_gsm8k.py (TRL's GRPOTrainer on grpo.py's GSM8K recipe) on CPU. Without TRL (CI has none): the prompt ids
TRL would see against grpo.py's, the reward wrapper against grpo.py's scoring, the batch arithmetic, the mapping of
the recipe's flags, the learning-rate schedule and the queue dev/queues/trl_gsm8k.txt. With TRL importable (its
wheel on PYTHONPATH) also TRL's own tokenisation, sampler and config arithmetic, and a 2-step run on a tiny model."""
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, recipe_flags

import grpo  # noqa: E402
from bench import trl_gsm8k as T  # noqa: E402
from common.args import cli  # noqa: E402
from common.data import PromptSampler, build_prompts  # noqa: E402
from common.rewards import load_reward_fn  # noqa: E402
from common.rl_setup import load_prompt_splits  # noqa: E402
from common.rollout import Rollout, score_rollout  # noqa: E402

HAS_TRL = importlib.util.find_spec("trl") is not None
needs_trl = pytest.mark.skipif(not HAS_TRL, reason="TRL is not installed (bench/trl_gsm8k.py's peer; put its wheel on "
                                                   "PYTHONPATH to run this part)")
RECIPE = recipe_flags("grpo_gsm8k_qwen05b.sh", '"${SCRIPT:-grpo.py}" \\\n')
QUESTIONS = ["Tom has 3 apples and buys 4 more. How many apples does he have?",
             "A train travels 60 km in 1.5 hours. What is its average speed in km/h?",
             "  Leading spaces, a tab\tand a line\nbreak: what is 7 x 8? ",
             "Sara's café sells 12 crêpes a day. How many in a week?"] * 20


def parse(monkeypatch, module, argv):
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *argv])
    return cli(module.Args)


def recipe_args(monkeypatch, tmp_path, *extra, module=T):
    subst = {"$MODEL": str(tmp_path / "m.gguf"), "$DATA": str(tmp_path / "data"), "$OUT_DIR": str(tmp_path / "out")}
    return parse(monkeypatch, module, [subst.get(a, a) for a in RECIPE] + list(extra))


def gsm8k_folder(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "test"):
        data.joinpath(f"{split}.jsonl").write_text("".join(
            json.dumps({"question": q, "answer": f"work\n#### {i}"}) + "\n" for i, q in enumerate(QUESTIONS)))
    return data


# ---- prompts -------------------------------------------------------------------------------------------------
def test_rendered_prompts_tokenise_to_grpos_ids(monkeypatch, tmp_path, tokenizer):
    """The recipe's rendering (instruction, chat template) through grpo.py's own code, then TRL 1.16's tokenisation of
    the text (its line for text prompts): the same ids, on all prompts of the run in grpo.py's order."""
    gsm8k_folder(tmp_path)
    args = recipe_args(monkeypatch, tmp_path, "--prompts-per-step", "4", "--num-steps", "5")
    train, dropped, _, _ = load_prompt_splits(args, tokenizer, 0, 1)
    assert len(train) == len(QUESTIONS) and dropped == 0
    assert train[0].prompt_text.startswith("<|im_start|>") and args.instruction in train[0].prompt_text
    rows = T.ordered_prompts(train, args.prompts_per_step, args.seed, args.num_steps)
    line = T.check_prompt_ids(tokenizer, rows, 200)
    assert line.startswith(f"prompt ids: TRL's tokenisation of {len(rows)} prompts equals grpo.py's")
    assert T.trl_tokenize(tokenizer, [e.prompt_text for e in rows]) == [e.prompt_ids for e in rows]


def test_the_check_stops_on_a_tokenisation_that_adds_a_token(tokenizer):
    """A tokenizer that adds a BOS to text (TRL's call uses the default special tokens) must fail the check, naming
    where the ids part."""
    examples, _ = build_prompts([{"question": q, "answer": "1"} for q in QUESTIONS[:4]], tokenizer)

    class WithBos:
        def __call__(self, text):
            return {"input_ids": [[0] + tokenizer(t, add_special_tokens=False)["input_ids"] for t in text]}

    with pytest.raises(ValueError, match="first difference at token 0"):
        T.check_prompt_ids(WithBos(), examples, 4)


def test_trl_reads_grpos_prompt_order(tokenizer):
    """Rollout step k of the TRL run samples the prompts grpo.py's sampler gives at step k (TRL: shuffle_dataset
    False, P consecutive rows per generation)."""
    examples, _ = build_prompts([{"question": f"{q} ({i})", "answer": "1"} for i, q in enumerate(QUESTIONS)], tokenizer)
    rows = T.ordered_prompts(examples, 8, 2, 12)  # 96 draws of 80 prompts: the second epoch reshuffles
    sampler = PromptSampler(examples, 8, 2, rank=0, world_size=1)
    for step in range(12):
        assert rows[step * 8:(step + 1) * 8] == sampler.next_batch()


@needs_trl
def test_trls_own_tokenisation_and_sampler(tokenizer):
    from trl import GRPOTrainer
    from trl.trainer.utils import RepeatSampler
    examples, _ = build_prompts([{"question": q, "answer": "1"} for q in QUESTIONS], tokenizer)
    assert T.check_prompt_ids(tokenizer, examples, 200, GRPOTrainer).startswith("prompt ids: TRL's tokenisation of 80")
    # shuffle off: generation g holds rows g*P .. g*P+P-1, each G times in a row, repeated for its micro-steps
    P, G, S = 4, 8, 16
    idx = list(RepeatSampler(range(12), mini_repeat_count=G, batch_size=P, repeat_count=S, shuffle=False))
    gen = [idx[g * P * G * S:(g + 1) * P * G * S] for g in range(3)]
    assert [sorted(set(x)) for x in gen] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert gen[1][:G + 1] == [4] * G + [5]


# ---- reward --------------------------------------------------------------------------------------------------
COMPLETIONS = ["She has 3 + 4 = 7.\n#### 7", "#### 8", "The answer is \\boxed{7}.", "7 apples, so\n#### 7.0",
               "no number at all", "#### 1,007", ""]


@pytest.mark.parametrize("format_coef", [0.0, 0.1])
def test_reward_wrapper_returns_grpos_rewards(tokenizer, format_coef):
    """TRL's call (prompts, completions, answer=..., log_metric=...) gives what grpo.py's score_rollout gives for the
    same decoded completions: its reward function, timeout and format shaping."""
    prompts, answers = ["p"] * len(COMPLETIONS), ["x\n#### 7"] * 5 + ["#### 1007", "#### 0"]
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in COMPLETIONS]
    examples = [type("E", (), {"prompt_text": p, "answer": a})() for p, a in zip(prompts, answers)]
    rollout = Rollout([[0]] * len(ids), ids, None, ["stop"] * len(ids))
    part, texts, _, _ = score_rollout(rollout, examples, load_reward_fn("math"), tokenizer, 10.0, format_coef, 16, {})
    logged = {}
    fn = T.trl_reward(load_reward_fn("math"), 10.0, format_coef, "math")
    got = fn(prompts=prompts, completions=texts, completion_ids=ids, answer=answers, trainer_state=None,
             log_metric=lambda k, v: logged.setdefault(k, v))
    assert got == part.rewards.tolist() and fn.__name__ == "math"
    assert [r >= 1 for r in got] == [True, False, True, True, False, True, False]  # correct (+ format shaping)
    assert logged == {"correct_frac": pytest.approx(4 / 7), "reward_errors": 0.0, "reward_timeouts": 0.0}


# ---- batch geometry, flags, schedule ---------------------------------------------------------------------------
def test_64_prompts_x_8_give_2_optimiser_steps_of_256():
    for micro, world in ((32, 1), (16, 1), (64, 1), (8, 2), (32, 2)):
        cfg = T.trl_geometry(64, 8, 2, 1, micro, world)
        assert T.trl_batches(cfg, world) == {"sequences_per_generation": 512, "optimizer_steps_per_generation": 2,
                                             "sequences_per_optimizer_step": 256}
    assert T.trl_geometry(64, 8, 2, 1, 32, 1) == {"num_generations": 8, "per_device_train_batch_size": 32,
                                                  "gradient_accumulation_steps": 8, "steps_per_generation": 16,
                                                  "num_iterations": 1}
    assert T.trl_batches(T.trl_geometry(64, 8, 4, 2, 32, 1), 1)["optimizer_steps_per_generation"] == 8  # 4 x 2 epochs
    with pytest.raises(ValueError, match="--trl-micro-batch 48"):
        T.trl_geometry(64, 8, 2, 1, 48, 1)
    with pytest.raises(ValueError, match="--num-minibatches 3"):
        T.trl_geometry(64, 8, 3, 1, 32, 1)


@needs_trl
def test_trls_config_makes_the_same_geometry(monkeypatch, tmp_path):
    """TRL's own GRPOConfig arithmetic on the recipe's mapped fields (CPU: bf16 off)."""
    from trl import GRPOConfig
    args = recipe_args(monkeypatch, tmp_path, "--num-steps", "40")
    cfg = GRPOConfig(**T.grpo_config_kwargs(args, 1, False, False, str(tmp_path / "trl")))
    assert (cfg.generation_batch_size, cfg.steps_per_generation, cfg.gradient_accumulation_steps) == (512, 16, 8)
    assert (cfg.max_steps, cfg.loss_type, cfg.epsilon_high) == (80, "dapo", 0.28)
    assert (cfg.vllm_importance_sampling_mode, cfg.vllm_importance_sampling_clip_max) == ("token_truncate", 2.0)


def test_the_recipes_flags_map_onto_trl(monkeypatch, tmp_path):
    args = recipe_args(monkeypatch, tmp_path, "--num-steps", "40", "--eval-every", "20", "--save-every", "20")
    assert T.unsupported(args) == []
    kw = T.grpo_config_kwargs(args, 1, True, True, "o")
    want = {"num_generations": 8, "per_device_train_batch_size": 32, "gradient_accumulation_steps": 8,
            "steps_per_generation": 16, "num_iterations": 1, "max_steps": 80, "seed": 2, "shuffle_dataset": False,
            "learning_rate": 2e-6, "adam_beta1": 0.9, "adam_beta2": 0.99, "weight_decay": 0.0, "max_grad_norm": 1.0,
            "beta": 0.0, "loss_type": "dapo", "scale_rewards": "group", "epsilon": 0.2, "epsilon_high": 0.28,
            "importance_sampling_level": "token", "mask_truncated_completions": False, "temperature": 1.0,
            "top_p": 1.0, "top_k": 0, "max_completion_length": 512, "vllm_max_model_length": 768,
            "vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_truncate",
            "vllm_importance_sampling_clip_max": 2.0, "use_vllm": True, "vllm_mode": "colocate", "bf16": True,
            "generation_kwargs": None, "gradient_checkpointing": False}
    assert {k: kw[k] for k in want} == want
    assert (args.max_prompt_tokens, args.chat_template, args.reward_fn, args.format_coef) == (256, True, "math", 0.0)


def test_flags_trl_cannot_reproduce_stop_with_one_line(monkeypatch, tmp_path):
    args = recipe_args(monkeypatch, tmp_path, "--kl-coef", "0.04", "--loss-agg", "seq-mean-token-sum-verl",
                       "--dynamic-sampling")
    bad = T.unsupported(args)
    assert len(bad) == 3 and bad[0].startswith("--kl-coef") and "--loss-agg seq-mean-token-sum-verl" in bad[1]
    with pytest.raises(SystemExit, match="not reproducible in TRL: --kl-coef.*; --loss-agg.*; --dynamic-sampling"):
        T.main(args)  # before TRL is imported or anything is loaded
    args = recipe_args(monkeypatch, tmp_path, "--loss-agg", "seq-mean-token-mean", "--no-scale-by-std",
                       "--overlong", "mask", "--tis-cap", "0")
    kw = T.grpo_config_kwargs(args, 1, True, True, "o")
    assert (kw["loss_type"], kw["scale_rewards"], kw["mask_truncated_completions"],
            kw["vllm_importance_sampling_correction"]) == ("grpo", "none", True, False)


def test_the_flags_are_grpos_own():
    """bench/ never imports a script, so bench/trl_gsm8k.py repeats grpo.py's fields: every one, with its type and
    default (a flag grpo.py gains, renames or re-defaults fails here), and grpo.py's lr_lambda verbatim."""
    import dataclasses
    import inspect
    mine = {f.name: f for f in dataclasses.fields(T.Args)}
    theirs = {f.name: f for f in dataclasses.fields(grpo.Args)}
    assert set(mine) - set(theirs) == {"trl_micro_batch", "trl_vllm_gpu_memory_utilization", "trl_vllm_sleep",
                                       "trl_gradient_checkpointing", "check_prompts"}
    for name, f in theirs.items():
        assert name in mine and mine[name].type == f.type, name
        if name != "exp_name":
            default = (lambda x: x.default if x.default is not dataclasses.MISSING else x.default_factory())
            assert default(mine[name]) == default(f), name
    src = inspect.getsource(T.lr_lambda)
    assert src == inspect.getsource(grpo.lr_lambda) and "# Same as grpo.py:lr_lambda" in inspect.getsource(T)
    assert T.Args(prompts_per_step=64).sequences_per_step == grpo.Args(prompts_per_step=64).sequences_per_step == 512


def test_the_learning_rate_follows_grpos_schedule_per_rollout_step():
    """The scheduler handed to TRL steps once per optimiser step; two optimiser steps of one rollout share grpo.py's
    lr_lambda of that rollout step (5 warm-up steps from 1/5, then constant)."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=2e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, T.lr_per_optimizer_step(2, 5, 40, "constant"))
    lrs = []
    for _ in range(16):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([2e-6 * min(1, (s // 2 + 1) / 5) for s in range(16)])
    assert lrs[0] == lrs[1] == pytest.approx(4e-7) and lrs[8] == lrs[15] == pytest.approx(2e-6)
    cos = T.lr_per_optimizer_step(2, 0, 10, "cosine")
    assert [cos(s) for s in range(20)] == [grpo.lr_lambda(s // 2, 0, 10, "cosine") for s in range(20)]


def test_a_rollout_row_merges_its_optimiser_steps_logs():
    logs = [{"loss": 0.2, "grad_norm": 1.0, "learning_rate": 4e-7, "reward": 0.5, "completions/mean_length": 210.0,
             "clip_ratio/region_mean": 0.0, "epoch": 0.1, "note": "text", "flag": True, "none": None},
            {"loss": -0.1, "grad_norm": 3.0, "learning_rate": 8e-7, "clip_ratio/region_mean": 0.02, "epoch": 0.2}]
    row = T.rollout_row(logs)
    assert row["reward/mean"] == 0.5 and row["rollout/response_len_mean"] == 210.0
    assert row["train/loss"] == pytest.approx(0.05) and row["train/grad_norm"] == 2.0
    assert row["train/lr"] == 4e-7 and row["train/clip_frac"] == pytest.approx(0.01)  # the lr the rollout began with
    assert row["trl/epoch"] == pytest.approx(0.15) and not {"trl/note", "trl/flag", "trl/none"} & set(row)


# ---- the queue -----------------------------------------------------------------------------------------------
def queue_jobs(monkeypatch):
    """dev/queues/trl_gsm8k.txt: per job, (script, parsed Args, the shell text) of its recipe launch; the recipe's
    $MODEL / $DATA / $OUT_DIR from the launch's assignments ($C from an earlier `C=...;` of the job)."""
    sys.path.insert(0, str(ROOT / "dev"))
    from gpu_queue import read_queue
    seps, jobs = (";", "&&", "||", "{", "}"), {}
    for name, gpus, cmd in read_queue(ROOT / "dev" / "queues" / "trl_gsm8k.txt"):
        assert gpus == frozenset("0"), name
        lex = shlex.shlex(cmd, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        words, shell_vars = list(lex), {}
        for i, w in enumerate(words):
            if "=" in w and (i == 0 or words[i - 1] in seps) and words[i + 1:i + 2] == [";"]:  # C=...;
                shell_vars.update([w.split("=", 1)])
            if w != "runs/grpo_gsm8k_qwen05b.sh":
                continue
            start = max((j for j in range(i) if words[j] in seps), default=-1) + 1
            env = dict(a.split("=", 1) for a in words[start:i - 1])  # the assignments before `bash`
            env = {k: shell_vars.get(v[1:], v) if v.startswith("$") else v for k, v in env.items()}
            end = next((j for j in range(i, len(words)) if words[j] in seps), len(words))
            subst = {"$MODEL": env["MODEL"], "$DATA": env["DATA"], "$OUT_DIR": env["OUT_DIR"]}
            script = T if env.get("SCRIPT") == "bench/trl_gsm8k.py" else grpo
            jobs[name] = (script, parse(monkeypatch, script, [subst.get(a, a) for a in RECIPE] + words[i + 1:end]), cmd)
    return jobs


def test_the_queue_runs_trl_evaluates_its_checkpoints_and_pairs_the_step_times(monkeypatch):
    """Every job parses with its script's flags (a renamed flag would otherwise show up on the GPU machine); the
    evaluations read the checkpoints the TRL run writes, with the recipe's evaluation flags and no training."""
    from common.engine_process import check_engine_args
    jobs = queue_jobs(monkeypatch)
    assert set(jobs) == {"grpo40", "trl40", "trleval20", "trleval40", "tgrpo", "ttrl"}
    g40_script, g40, _ = jobs["grpo40"]  # grpo.py's side of the learning comparison: the recipe, 40 steps
    assert g40_script is grpo and (g40.num_steps, g40.eval_every, g40.eval_size, g40.save_every) == (40, 20, 1319, 0)
    trl_script, trl, trl_cmd = jobs["trl40"]
    assert trl_script is T and "PYTHONPATH=/tmp/peers:$PYTHONPATH" in trl_cmd and "/tmp/assets/whl/*.whl" in trl_cmd
    assert (trl.num_steps, trl.save_every, T.unsupported(trl)) == (40, 20, [])
    assert T.grpo_config_kwargs(trl, 1, True, True, "o")["max_steps"] == 80
    for k in (20, 40):
        script, ev, _ = jobs[f"trleval{k}"]
        assert script is grpo and ev.model == f"{trl.out_dir}/{trl.exp_name}/checkpoints/step_{k}"
        assert k % trl.save_every == 0 and k <= trl.num_steps
        assert (ev.num_steps, ev.eval_every > 0, ev.eval_size, ev.eval_n, ev.seed) == (0, True, 1319, 0, 2)
        check_engine_args(ev.vllm)
    (g_script, g, _), (t_script, t, t_cmd) = jobs["tgrpo"], jobs["ttrl"]
    assert (g_script, t_script) == (grpo, T) and "PYTHONPATH=/tmp/peers" in t_cmd
    assert (g.num_steps, t.num_steps, g.eval_every, t.save_every) == (4, 4, 0, 0)
    assert g.model == t.model == trl.model == "/tmp/qwen.gguf"
    same = {k for k in vars(g) if k not in ("exp_name", "vllm", "fsdp", "lora")}
    assert {k: getattr(g, k) for k in same} == {k: getattr(t, k) for k in same}  # the recipe's flags, both sides
    check_engine_args(g.vllm)


# ---- end to end (TRL on CPU, transformers generate) --------------------------------------------------------------
@pytest.mark.slow
@needs_trl
def test_two_steps_on_a_tiny_model_write_rows_and_loadable_checkpoints(tmp_path, tiny_model_dir):
    """bench/trl_gsm8k.py with TRL, no vLLM: the start-up check, one metrics row per rollout step with grpo.py's
    warm-up, and a checkpoint per step holding trained weights beside the model folder's own config and tokenizer."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "bench/trl_gsm8k.py", "--model", str(tiny_model_dir), "--dataset", "arith-easy",
                        "--rollout", "hf", "--device", "cpu", "--prompts-per-step", "2", "--group-size", "2",
                        "--num-minibatches", "2", "--max-new-tokens", "8", "--num-steps", "2", "--trl-micro-batch", "1",
                        "--save-every", "1", "--lr", "1e-3", "--warmup-steps", "2", "--reward-fn", "bench.w05:reward",
                        "--out-dir", str(out), "--exp-name", "t"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "prompt ids: TRL's tokenisation of 4 prompts equals grpo.py's" in p.stdout
    assert "stop tokens: grpo.py [2], TRL [2] (equal)" in p.stdout
    rows = [json.loads(line) for line in (out / "t" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [0, 1]
    assert [r["train/lr"] for r in rows] == pytest.approx([5e-4, 1e-3])  # grpo.py's warm-up, per rollout step
    assert all(r["perf/step_s"] > 0 and "reward/mean" in r and "trl/loss" in r for r in rows)
    summary = json.loads(p.stdout.strip().splitlines()[-1].removeprefix("TRL_GSM8K "))
    ckpt = out / "t" / "checkpoints"
    assert summary["checkpoints"] == [str(ckpt / "step_1"), str(ckpt / "step_2")] and len(summary["steps"]) == 2
    src = load_file(tiny_model_dir / "model.safetensors")
    for k in (1, 2):
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (ckpt / f"step_{k}" / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    w1, w2 = (load_file(ckpt / f"step_{k}" / "model.safetensors") for k in (1, 2))
    assert set(w2) == set(src) and all(w2[n].dtype == torch.float32 for n in w2)
    assert any(not torch.equal(w1[n], src[n].float()) for n in src)  # trained: the weights moved
    assert any(not torch.equal(w2[n], w1[n]) for n in src)
    AutoModelForCausalLM.from_pretrained(ckpt / "step_2")
    assert not list(ckpt.glob("*.tmp*"))


# ---- the figure and table (tools/grpo_vs_trl_gsm8k.py) -----------------------------------------------------------
def test_the_comparison_tool_reads_both_trainers_runs(tmp_path):
    """Accuracy per evaluation step for both trainers (TRL's step 0 is grpo.py's: the same model and evaluator) and
    for a further grpo.py run, minutes = the step times before that step, the table's medians skip step 0, the
    accuracy differences of each two runs carry their standard error, so do the mean training-reward differences, the
    window table averages the steps both trainers have (grpo.py stopped one step early here) with each window's median
    step and generation times (for the trainers, and for grpo.py beside a further run), the steps table shows each
    run's reward and times at chosen steps, the same-host pairs give their step and update times and step-time
    ratios, and the figure is written."""
    from tools import grpo_vs_trl_gsm8k as C

    def write(d, rs, replace=False):
        d.mkdir(parents=True, exist_ok=replace)
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
        (d / "config.json").write_text("{}")  # a run folder: tools.compare.load_run reads both
    write(tmp_path / "grpo", [{"step": 0, "eval/accuracy": 0.25}] +
          [{"step": i, "perf/step_s": 60.0 if i == 0 else 6.0, "perf/peak_mem_gib": 20.0 + i, "reward/mean": 0.1 * i,
            "perf/generate_s": 1.0 + i, "perf/update_s": 2.0 * i} for i in range(4)] +
          [{"step": 2, "eval/accuracy": 0.3}, {"step": 4, "eval/accuracy": 0.35}])
    write(tmp_path / "trl", [{"step": i, "perf/step_s": 18.0, "perf/peak_mem_gib": 70.0, "reward/mean": 0.2}
                             for i in range(5)])
    write(tmp_path / "trl_eval_step2", [{"step": 0, "eval/accuracy": 0.29}])
    write(tmp_path / "trl_eval_step4", [{"step": 0, "eval/accuracy": 0.34}])
    write(tmp_path / "grpo_b", [{"step": 0, "eval/accuracy": 0.25}, {"step": 2, "eval/accuracy": 0.27}] +
          [{"step": i, "perf/step_s": 5.0, "reward/mean": 0.1 * i + (0.02 if i % 2 else 0.0)} for i in range(3)])
    c = C.curves(tmp_path)
    assert list(c) == ["grpo.py", "TRL"]
    def flat(name):
        return [x for p in c[name]["points"] for x in p]
    assert flat("grpo.py") == pytest.approx([0, 0, 25, 2, 66 / 60, 30, 4, 78 / 60, 35])
    assert flat("TRL") == pytest.approx([0, 0, 25, 2, 36 / 60, 29, 4, 72 / 60, 34])
    assert c["grpo.py"]["peak"] == 23.0 and c["TRL"]["peak"] == 70.0
    t = C.table(c)
    assert "| grpo.py | 25.00 % (0.0) | 30.00 % (1.1) | 35.00 % (1.3) | 4 | 6.00 | 1.3 | 23.0 |" in t
    assert "| TRL | 25.00 % (0.0) | 29.00 % (0.6) | 34.00 % (1.2) | 5 | 18.00 | 1.5 | 70.0 |" in t
    se2 = 100 * (0.3 * 0.7 / 1319 + 0.29 * 0.71 / 1319) ** 0.5
    assert C.differences(c) == [f"step 2: grpo.py - TRL = +1.00 points (standard error {se2:.2f})",
                                "step 4: grpo.py - TRL = +1.00 points (standard error 1.85)"]
    assert C.window_table(c, width=3).splitlines()[2:] == ["| 0-2 | 0.100 | 0.200 | -0.100 | 6.00 | 18.00 | 2.00 |",
                                                           "| 3-3 | 0.300 | 0.200 | +0.100 | 6.00 | 18.00 | 4.00 |"]
    assert C.moving_average([1.0, 2.0, 3.0, 4.0], k=2) == [1.0, 1.5, 2.5, 3.5]
    c3 = C.curves(tmp_path, ("grpo_b",))
    assert list(c3) == ["grpo.py", "TRL", "grpo.py (grpo_b/)"] and c3["grpo.py"] == c["grpo.py"]
    assert [p[2] for p in c3["grpo.py (grpo_b/)"]["points"]] == pytest.approx([25, 27])
    assert C.differences(c3)[2:] == [f"step 2: grpo.py - grpo.py (grpo_b/) = +3.00 points (standard error "
                                     f"{100 * (0.3 * 0.7 / 1319 + 0.27 * 0.73 / 1319) ** 0.5:.2f})",
                                     "step 2: TRL - grpo.py (grpo_b/) = +2.00 points (standard error "
                                     f"{100 * (0.29 * 0.71 / 1319 + 0.27 * 0.73 / 1319) ** 0.5:.2f})"]
    # grpo.py - TRL per step: -0.2, -0.1, 0, +0.1 (mean -0.05); grpo.py - grpo_b: 0, -0.02, 0
    se = statistics.stdev([-0.2, -0.1, 0.0, 0.1]) / 2
    assert C.reward_differences(c3) == [
        f"training reward, grpo.py - TRL: -0.0500 a step over 4 steps (standard error {se:.4f})",
        f"training reward, grpo.py - grpo.py (grpo_b/): -0.0067 a step over 3 steps (standard error "
        f"{statistics.stdev([0, -0.02, 0]) / 3 ** 0.5:.4f})",
        f"training reward, TRL - grpo.py (grpo_b/): +0.0933 a step over 3 steps (standard error "
        f"{statistics.stdev([0.2, 0.08, 0.0]) / 3 ** 0.5:.4f})"]
    assert C.window_table(c3, width=3) == C.window_table(c, width=3)  # the two trainers only
    assert C.window_table(c3, width=3, names=("grpo.py", "grpo.py (grpo_b/)")).splitlines()[2:] == [
        "| 0-2 | 0.100 | 0.107 | -0.007 | 6.00 | 5.00 | 2.00 |"]  # grpo_b logs no generation time
    assert C.steps_table(c3, (0, 3)).splitlines()[2:] == [
        "| grpo.py | 0 | 0.000 | 60.00 | 0.00 | 1.00 |", "| grpo.py | 3 | 0.300 | 6.00 | 6.00 | 4.00 |",
        "| TRL | 0 | 0.200 | 18.00 | - | - |", "| TRL | 3 | 0.200 | 18.00 | - | - |",
        "| grpo.py (grpo_b/) | 0 | 0.000 | 5.00 | - | - |", "| grpo.py (grpo_b/) | 3 | - | - | - | - |"]
    # same-host pairs: the timing folder itself and a subfolder; a folder without trl/ is not a pair
    timing = tmp_path / "timing"
    for d, g, t in ((timing, [30.0, 6.0, 18.0, 7.0], [19.0, 17.0, 16.0, 16.5]),
                    (timing / "second_pair", [28.0, 7.5, 14.5, 7.25], [22.0, 20.0, 22.0, 21.0])):
        write(d / "grpo", [{"step": i, "perf/step_s": s, "perf/update_s": s - 5} for i, s in enumerate(g)])
        write(d / "trl", [{"step": i, "perf/step_s": s, "perf/peak_mem_gib": 70.0 + i} for i, s in enumerate(t)])
    write(timing / "only_grpo" / "grpo", [{"step": 0, "perf/step_s": 1.0}])
    assert C.pairs(timing) == [timing, timing / "second_pair"]
    lines = C.pair_table(timing / "second_pair").splitlines()
    assert lines[2:6] == ["| 0 | 28.00 | 23.00 | 22.00 |", "| 1 | 7.50 | 2.50 | 20.00 |",
                          "| 2 | 14.50 | 9.50 | 22.00 |", "| 3 | 7.25 | 2.25 | 21.00 |"]
    assert lines[6] == ("steps 1-: median grpo.py 7.50 s, TRL 21.00 s: 2.80x; "
                        f"mean 9.75 s, 21.00 s: {21 / 9.75:.2f}x")
    assert len(lines) == 7  # grpo.py logs no peak here: no peak line
    write(timing / "second_pair" / "grpo", [{"step": i, "perf/step_s": 9.0, "perf/update_s": 1.0,
                                             "perf/peak_mem_gib": 26.0 + i} for i in range(2)], replace=True)
    assert C.pair_table(timing / "second_pair").splitlines()[-1] == "trainer peak: grpo.py 27.0 GiB, TRL 73.0 GiB"
    C.main(C.Args(run_dir=tmp_path, extra=("grpo_b",), timing_dir=timing))
    assert (tmp_path / "curves.png").stat().st_size > 10_000
