"""verl's GRPO on workload W05, for a side-by-side with grpo.py and TRL (run by bench/w05.py --verl).

verl 0.9.1 (https://github.com/volcengine/verl), FSDP actor + reference, vLLM rollout colocated (an AsyncLLM server
in a Ray actor, slept between generations), driven through its own entry point `python -m verl.trainer.main_ppo`
with hydra overrides: GRPO advantage (std-scaled), n = 8, 64 prompts per step, 256 prompt + 512 new tokens with
ignore_eos, temperature 1, KL loss k3 (`low_var_kl`) 0.04 against the reference model, lr 1e-6, one optimiser step
per generation (ppo_mini_batch_size = train batch, one epoch), dynamic batches of 16384 tokens per GPU as
bench/w05.py gives grpo.py, no gradient checkpointing (grpo.py's default), TP 1, sleep mode (free_cache_engine),
gpu_memory_utilization 0.35, no validation, no checkpoints, console logger. Same inputs as the other sub-runs: the
model folder and prompts jsonl that bench/w05.py wrote, and the reward len(completion) % 7 (`compute_score` below,
verl's custom reward signature).

Where it differs from grpo.py and TRL (verl's own design, kept as people run it):
  1. Prompts: verl always renders a chat template (agent loop, utils/tokenizer/continuous_token.py). The override
     sets a template that emits the message content only, so the prompt tokens are tokenizer(question + "\\n"),
     grpo.py's with --no-chat-template --instruction ""; --check-config verifies this with verl's own builder.
  2. The completion the reward sees is decoded with skip_special_tokens=True (verl's naive reward manager).
  3. verl recomputes pi_old with the actor before the update (timing_s/old_log_prob); grpo.py takes it from the
     update's first pass. Reported as its own phase.
  4. Attention: sdpa with padding kept (use_remove_padding=False): flash-attn is not in the GPU host's bundle.
  5. FSDP2 as grpo.py, but verl keeps the actor's parameters in fp32 (fsdp_config.model_dtype) with bf16 compute.
Entry point: trainer.use_v1=False, the RayPPOTrainer loop (trainer/main_ppo_v0.py's TaskRunner), still in 0.9.1
though marked deprecated. It needs no TransferQueue (verl's transfer_queue import falls back to a stub); the default
v1 TaskRunner (main_ppo.py) starts TransferQueue's controller and storage actors on top. --trainer v1 runs that one.

Staging on a GPU host without network access (dev/README.md):
  here:   VERL=1 bash dev/gpu_assets.sh SRC   # the antlr4 4.9.3 wheel (an sdist only on PyPI), then the bundle of
          dev/verl-bundle.txt, 96.8 MB of wheels (.gpu-assets/ is ignored by git; one part-NN per command)
  there:  mkdir -p /tmp/verl-site && cat /tmp/stage/part-* | tar -xJ -C /tmp/verl-site
          export PYTHONPATH=/tmp/site       # the base bundle (vllm 0.26.0, datasets, wandb, ...), as for grpo.py
          python bench/verl_w05.py --model ... --prompts ... --check-config --site /tmp/verl-site  # seconds, first
          python bench/w05.py --tokenizer-tar ... --only verl --verl --verl-site /tmp/verl-site --num-steps 4
  Run verl as a command of its own (--only verl; the build is reused from --work-dir);
  --timeout (540 s, bench/w05.py passes its own minus 20) kills verl's process group and still prints VERL_W05.
  --site goes FIRST on the child's PYTHONPATH (this script puts it there, for this run only): verl's transformers 5.9
  and tokenizers 0.22.2 shadow the image's 5.17 and 0.23.3 (verl pins <5.11), antlr4 4.9.3 shadows the base
  bundle's 4.13.2 (hydra's grammar needs 4.9). Ray actors inherit the environment, so the order holds in the workers
  too.
  Environment set here for the child: VLLM_USE_FLASHINFER_SAMPLER=0 (flashinfer is not bundled), NCCL_NVLS_ENABLE=0,
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 (NVLink multicast off), TOKENIZERS_PARALLELISM=false,
  WANDB_MODE=disabled; VLLM_ENABLE_V1_MULTIPROCESSING (bench/w05.py sets it to 0 for in-process engines) is removed:
  verl runs vLLM as a server.
  vLLM: try the base bundle's 0.26.0 first (verl 0.9's imports exist in it: vllm/entrypoints/openai/api_server.py,
  .../parser/harmony_utils.py, v1/engine/async_llm.py); verl 0.9.1 pins 0.24.0, the fallback: uncomment the vllm
  block of dev/verl-bundle.txt and rebuild (it then shadows 0.26 through --site).

    python bench/verl_w05.py --model /tmp/w05/model-0.5b --prompts /tmp/w05/prompts.jsonl --out /tmp/verl_w05
    python bench/verl_w05.py --model ... --prompts ... --check-config     # CPU: compose + verl's validation only
Last line: VERL_W05 {"steps": [...], "median_warm_s": ..., "phases": {...}, "peak_mem_gib": ...}
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
W05 = dict(prompts_per_step=64, group_size=8, prompt_tokens=256, new_tokens=512, kl_coef=0.04, lr=1e-6,
           max_tokens_per_gpu=16384, gpu_memory_utilization=0.35)  # as bench/w05.py:W05 and trl_w05.py
CONTENT_ONLY_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
DATA_SOURCE = "w05"


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl's custom reward signature (reward.custom_reward_function); same as bench/w05.py:reward."""
    return float(len(solution_str) % 7)


def parquet_rows(questions: list[str]) -> list[dict]:
    """Rows of verl's RLHF parquet schema: a one-message chat whose content is grpo.py's prompt text."""
    return [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": q + "\n"}],
             "reward_model": {"style": "rule", "ground_truth": "0"}, "extra_info": {"index": i}}
            for i, q in enumerate(questions)]


def write_parquet(prompts: Path, path: Path) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [json.loads(line) for line in prompts.open() if line.strip()]
    if not rows or any("question" not in r for r in rows):
        raise SystemExit(f"--prompts {prompts}: need a jsonl with a 'question' per row (bench/w05.py writes it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(parquet_rows([r["question"] for r in rows])), path)
    return len(rows)


def overrides(model: str, data: str, out: str, steps: int, nproc: int = 1, trainer: str = "v0",
              gpu_memory_utilization: float = W05["gpu_memory_utilization"],
              max_tokens_per_gpu: int = W05["max_tokens_per_gpu"]) -> list[str]:
    """Hydra overrides on verl's ppo_trainer.yaml for exactly W05."""
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    return [
        "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=True", "algorithm.use_kl_in_reward=False",
        f"data.train_files={data}", f"data.val_files={data}", "data.prompt_key=prompt",
        f"data.train_batch_size={W05['prompts_per_step']}", f"data.max_prompt_length={W05['prompt_tokens']}",
        f"data.max_response_length={W05['new_tokens']}", "data.filter_overlong_prompts=False", "data.truncation=error",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.use_remove_padding=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f'actor_rollout_ref.model.custom_chat_template="{CONTENT_ONLY_TEMPLATE}"',
        f"{a}.strategy=fsdp2", f"{a}.fsdp_config.strategy=fsdp2", f"{a}.optim.lr={W05['lr']}",
        f"{a}.ppo_mini_batch_size={W05['prompts_per_step']}", f"{a}.ppo_epochs=1",  # one optimiser step per rollout
        f"{a}.use_dynamic_bsz=True", f"{a}.ppo_max_token_len_per_gpu={max_tokens_per_gpu}",
        f"{a}.use_kl_loss=True", f"{a}.kl_loss_coef={W05['kl_coef']}", f"{a}.kl_loss_type=low_var_kl",  # k3
        f"{a}.entropy_coeff=0", f"{a}.loss_agg_mode=token-mean",
        f"{a}.fsdp_config.param_offload=False", f"{a}.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.ref.fsdp_config.strategy=fsdp2", "actor_rollout_ref.ref.fsdp_config.param_offload=False",
        f"{r}.name=vllm", f"{r}.mode=async", f"{r}.n={W05['group_size']}", f"{r}.tensor_model_parallel_size=1",
        f"{r}.gpu_memory_utilization={gpu_memory_utilization}", f"{r}.free_cache_engine=True",
        f"{r}.ignore_eos=True", f"{r}.temperature=1.0", f"{r}.top_p=1.0", f"{r}.top_k=-1",
        f"{r}.max_num_seqs={W05['prompts_per_step'] * W05['group_size']}",
        f"{r}.max_model_len={W05['prompt_tokens'] + W05['new_tokens']}",
        f"reward.custom_reward_function.path={Path(__file__).resolve()}",
        "reward.custom_reward_function.name=compute_score",
        f"trainer.n_gpus_per_node={nproc}", "trainer.nnodes=1", f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=1", "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.resume_mode=disable", "trainer.logger=[console]", "trainer.project_name=w05",
        "trainer.experiment_name=verl", f"trainer.default_local_dir={out}/ckpt",
        f"trainer.use_v1={trainer == 'v1'}",
    ]


STEP_LINE = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")
NUMBER = re.compile(r"^(?:np\.\w+\()?([-+0-9.eE]+|nan|inf|-inf|True|False)\)?$")


def parse_console(text: str) -> list[dict]:
    """Per-step metrics from verl's console logger: LocalLogger.log prints concat_dict_to_str(metrics, step)
    (verl/utils/logger/aggregate_logger.py), i.e. `step:N - key:value - ...` with pprint.pformat(value) of every
    number (np.float64(x) for numpy scalars); Ray prefixes an actor's lines with `(TaskRunner pid=...)`."""
    steps = {}
    for line in text.splitlines():
        m = STEP_LINE.search(line.rstrip())
        if not m:
            continue
        row = {"step": int(m.group(1))}
        for part in m.group(2).split(" - "):
            key, _, val = part.partition(":")
            v = NUMBER.match(val.strip())
            if key and v:
                row[key] = {"True": 1.0, "False": 0.0}.get(v.group(1)) if v.group(1) in ("True", "False") \
                    else float(v.group(1))
        if "timing_s/step" in row:  # the training step's line (an initial validation line has no timing)
            steps[row["step"]] = row
    return [steps[k] for k in sorted(steps)]


def summarise(rows: list[dict], nproc: int = 1) -> dict:
    """Step times and per-phase medians over the warm steps (all but the first, as trl_w05.py)."""
    warm = rows[1:] or rows
    med = statistics.median(r["timing_s/step"] for r in warm) if warm else None
    tokens = W05["prompts_per_step"] * W05["group_size"] * (W05["prompt_tokens"] + W05["new_tokens"])
    phases = sorted({k for r in warm for k in r if k.startswith("timing_s/") and k != "timing_s/step"})
    return {"steps": [round(r["timing_s/step"], 2) for r in rows], "median_warm_s": med, "tokens_per_step": tokens,
            "tokens_per_s_per_gpu": tokens / med / nproc if med else None,
            "phases": {k[len("timing_s/"):]: statistics.median(r[k] for r in warm if k in r) for k in phases},
            "peak_mem_gib": max((r.get("perf/max_memory_allocated_gb", 0) for r in rows), default=None),
            "reward_mean": [r.get("critic/score/mean") for r in rows],
            "response_length_mean": [r.get("response_length/mean") for r in rows]}


def child_env(site: str | None) -> dict:
    env = {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0", "NCCL_NVLS_ENABLE": "0",
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1", "TOKENIZERS_PARALLELISM": "false",
           "WANDB_MODE": "disabled"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["PYTHONPATH"] = os.pathsep.join([p for p in [site, env.get("PYTHONPATH"), str(ROOT)] if p])
    return env


def make_executable(site: str | None) -> list[str]:
    """chmod +x the ELF files under <site>/ray (gcs_server, raylet, ...) that lack it: ray starts them as programs,
    and an unpack that drops the mode bits (seen on one H200, 2026-12-02) fails with "PermissionError: ...
    gcs_server"."""
    fixed = []
    for f in sorted((Path(site) / "ray").rglob("*")) if site else []:
        if f.is_file() and not os.access(f, os.X_OK) and f.open("rb").read(4) == b"\x7fELF":
            f.chmod(f.stat().st_mode | 0o111)
            fixed.append(str(f.relative_to(site)))
    return fixed


def check_config(ovr: list[str], prompts: Path, data: Path) -> None:
    """Everything but the launch, on CPU: compose the config from verl's packaged yaml with these overrides, run
    main_ppo.main's validate_config and the conversions to verl's dataclasses that TaskRunner.run and
    ActorRolloutRefWorker.init_model do (workers/engine_workers.py), load the reward function with verl's loader,
    read the parquet with RLHFDataset and render every prompt with verl's continuous-token builder."""
    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict
    from transformers import AutoTokenizer
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.trainer.ppo.utils import create_rl_dataset, need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=ovr)
    ref, critic = need_reference_policy(cfg), need_critic(cfg)
    assert ref and not critic, f"W05 needs a reference model and no critic (got ref={ref}, critic={critic})"
    validate_config(cfg, use_reference_policy=ref, use_critic=critic)  # as main_ppo.main and TaskRunner.run
    OmegaConf.resolve(cfg)
    arr = cfg.actor_rollout_ref
    model = omega_conf_to_dataclass(arr.model)  # HFModelConfig: tokenizer, hf_config with the attention override
    actor = omega_conf_to_dataclass(arr.actor)
    with open_dict(arr.ref):  # the renames ActorRolloutRefWorker.init_model makes before building the reference
        arr.ref.ppo_mini_batch_size = arr.actor.ppo_mini_batch_size
        arr.ref.ppo_micro_batch_size = arr.ref.pop("log_prob_micro_batch_size", None)
        arr.ref.ppo_micro_batch_size_per_gpu = arr.ref.pop("log_prob_micro_batch_size_per_gpu", None)
        arr.ref.use_dynamic_bsz = arr.ref.pop("log_prob_use_dynamic_bsz", False)
        arr.ref.ppo_max_token_len_per_gpu = arr.ref.pop("log_prob_max_token_len_per_gpu", None)
    ref_cfg = omega_conf_to_dataclass(arr.ref)
    rollout = omega_conf_to_dataclass(arr.rollout)
    ckpt_engine = omega_conf_to_dataclass(arr.rollout.checkpoint_engine)
    algo = omega_conf_to_dataclass(cfg.algorithm)
    assert arr.actor.use_dynamic_bsz == arr.rollout.log_prob_use_dynamic_bsz  # init_model's own assert
    got = {"adv_estimator": str(algo.adv_estimator), "norm_adv_by_std": algo.norm_adv_by_std_in_grpo,
           "n": rollout.n, "train_batch_size": cfg.data.train_batch_size,
           "ppo_mini_batch_size(prompts)": actor.ppo_mini_batch_size, "ppo_epochs": actor.ppo_epochs,
           "max_prompt_length": cfg.data.max_prompt_length, "max_response_length": cfg.data.max_response_length,
           "rollout.prompt/response_length": (rollout.prompt_length, rollout.response_length),
           "ignore_eos": rollout.ignore_eos, "temperature": rollout.temperature,
           "kl_loss": (actor.use_kl_loss, actor.kl_loss_coef, actor.kl_loss_type), "lr": actor.optim.lr,
           "dynamic_bsz tokens/GPU (actor, old logp, ref)": (actor.ppo_max_token_len_per_gpu,
                                                             arr.rollout.log_prob_max_token_len_per_gpu,
                                                             ref_cfg.ppo_max_token_len_per_gpu),
           "tp": rollout.tensor_model_parallel_size, "gpu_memory_utilization": rollout.gpu_memory_utilization,
           "free_cache_engine/enable_sleep_mode": (rollout.free_cache_engine, rollout.enable_sleep_mode),
           "max_num_seqs": rollout.max_num_seqs, "checkpoint_engine": ckpt_engine.backend,
           "attn_implementation": model.hf_config._attn_implementation,
           "strategy (actor, its engine, ref engine)": (actor.strategy, arr.actor.fsdp_config.strategy,
                                                         arr.ref.fsdp_config.strategy),
           "use_remove_padding": model.use_remove_padding, "grad_ckpt": model.enable_gradient_checkpointing,
           "n_gpus": cfg.trainer.n_gpus_per_node, "steps": cfg.trainer.total_training_steps,
           "use_v1": cfg.trainer.use_v1, "logger": list(cfg.trainer.logger)}
    for k, v in got.items():
        print(f"  {k}: {v}")
    assert (rollout.n, actor.ppo_mini_batch_size, cfg.data.train_batch_size) == (8, 64, 64)
    assert rollout.ignore_eos and rollout.free_cache_engine and rollout.enable_sleep_mode
    assert model.hf_config._attn_implementation == "sdpa" and not model.use_remove_padding

    fn = get_custom_reward_fn(cfg)  # verl's loader, with the reward kwargs partial it applies
    scores = [fn(data_source=DATA_SOURCE, solution_str="x" * k, ground_truth="0", extra_info={}) for k in range(9)]
    assert scores == [k % 7 for k in range(9)], scores
    ds = create_rl_dataset(cfg.data.train_files, cfg.data, model.tokenizer, model.processor, is_train=True)
    builder = create_continuous_token_builder(model.tokenizer, hf_model_type=model.hf_config.model_type,
                                              chat_template_kwargs=dict(cfg.data.apply_chat_template_kwargs),
                                              processor=model.processor)
    tok = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)  # plain, as grpo.py tokenises
    questions = [json.loads(line)["question"] for line in prompts.open() if line.strip()]
    assert len(ds) == len(questions), (len(ds), len(questions))
    lens = []
    for i in range(len(ds)):
        ids = builder.build_initial_tokens(list(ds[i]["raw_prompt"]))
        want = tok(questions[i] + "\n")["input_ids"]
        if ids != want:
            raise SystemExit(f"prompt {i}: verl renders {len(ids)} tokens {ids[:8]}..., grpo.py {len(want)} "
                             f"{want[:8]}...: the content-only chat template did not take")
        lens.append(len(ids))
    assert max(lens) <= cfg.data.max_prompt_length
    print(f"  prompts: {len(ds)} rows of {data}, verl's rendered ids == tokenizer(question + '\\n') for all; "
          f"tokens mean {statistics.mean(lens):.1f}, max {max(lens)}")
    print("VERL_W05_CONFIG ok")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model folder (bench/w05.py's <work-dir>/model-0.5b)")
    ap.add_argument("--prompts", required=True, help="jsonl with a 'question' per row (bench/w05.py writes it)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=1, help="GPUs (trainer.n_gpus_per_node)")
    ap.add_argument("--trainer", choices=["v0", "v1"], default="v0", help="v0: RayPPOTrainer (no TransferQueue); "
                    "v1: verl 0.9's default TaskRunnerV1 (needs TransferQueue)")
    ap.add_argument("--site", default=None, help="unpacked dev/verl-bundle.txt, put first on the child's PYTHONPATH")
    ap.add_argument("--extra", default="", help="more hydra overrides, space-separated (last wins)")
    ap.add_argument("--timeout", type=int, default=540, help="seconds; then verl's process group is killed (its Ray "
                    "processes with it) and the steps done so far are still reported")
    ap.add_argument("--out", default="/tmp/verl_w05")
    ap.add_argument("--check-config", action="store_true", help="compose and validate on CPU, launch nothing")
    a = ap.parse_args()
    if a.check_config and a.site and a.site not in sys.path:  # import verl and its pins as the run would
        raise SystemExit(subprocess.call([sys.executable] + sys.argv, env=child_env(a.site)))

    out, prompts = Path(a.out).resolve(), Path(a.prompts)
    data = out / "w05.parquet"
    n = write_parquet(prompts, data)
    ovr = overrides(str(Path(a.model).resolve()), str(data), str(out), a.steps, a.nproc, a.trainer) + a.extra.split()
    (out / "overrides.txt").write_text("\n".join(ovr) + "\n")
    print(f"{n} prompts -> {data}; {len(ovr)} overrides in {out / 'overrides.txt'}", flush=True)
    if a.check_config:
        return check_config(ovr, prompts, data)

    if fixed := make_executable(a.site):
        print(f"made {len(fixed)} files under {a.site}/ray executable: {', '.join(fixed[:5])}", flush=True)
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo"] + ovr
    log = out / "verl.log"
    with open(log, "w") as f:  # tee: bench/w05.py keeps only the tail of this process's output
        p = subprocess.Popen(cmd, cwd=out, env=child_env(a.site), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, errors="replace", start_new_session=True)
        timer = threading.Timer(a.timeout, os.killpg, (p.pid, signal.SIGKILL))
        timer.start()
        for line in p.stdout:
            f.write(line)
            print(line, end="", flush=True)
        rc = p.wait()
        timer.cancel()
    rows = parse_console(log.read_text(errors="replace"))
    print("VERL_W05 " + json.dumps({"rc": rc, **summarise(rows, a.nproc)}), flush=True)
    if rc != 0 or len(rows) < a.steps:
        raise SystemExit(f"verl exited {rc} after {len(rows)} of {a.steps} steps; its log: {log}")


if __name__ == "__main__":
    main()
