"""bench/verl_w05.py without verl (CI has none): the parquet and reward it hands verl, the W05 numbers in its hydra
overrides, and the parser of verl's console lines. verl itself is checked by `bench/verl_w05.py --check-config`."""
import json
import numbers
import os
import pprint
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from bench import verl_w05 as V
from bench.w05 import W05, reward


def parse_overrides(ovr: list[str]) -> dict[str, str]:
    keys = [o.split("=", 1)[0].lstrip("+") for o in ovr]
    assert len(keys) == len(set(keys)), f"a key set twice: {sorted(k for k in keys if keys.count(k) > 1)}"
    return {o.split("=", 1)[0].lstrip("+"): o.split("=", 1)[1] for o in ovr}


def test_parquet_rows_render_to_grpo_prompt_tokens(tmp_path, tokenizer):
    questions = ["What is 2 + 3?", "  leading spaces and a trailing one ", "line one\nline two"]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"question": q, "answer": "0"}) + "\n"
                                                    for q in questions))
    assert V.write_parquet(tmp_path / "prompts.jsonl", tmp_path / "d.parquet") == 3
    rows = pq.read_table(tmp_path / "d.parquet").to_pylist()
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2]
    assert {r["data_source"] for r in rows} == {V.DATA_SOURCE} and all(r["reward_model"]["ground_truth"] for r in rows)
    for q, r in zip(questions, rows):
        # what verl's agent loop does (utils/tokenizer/continuous_token.py:_render_tokens): apply_chat_template with
        # add_generation_prompt, here with the content-only template the override installs
        out = tokenizer.apply_chat_template(r["prompt"], chat_template=V.CONTENT_ONLY_TEMPLATE, tokenize=True,
                                            add_generation_prompt=True)
        ids = list(out["input_ids"] if isinstance(out, Mapping) else out)
        assert ids == tokenizer(q + "\n")["input_ids"]  # grpo.py: --no-chat-template --instruction ""


def test_bad_prompts_file_names_the_flag(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "no question field"}) + "\n")
    try:
        V.write_parquet(tmp_path / "p.jsonl", tmp_path / "d.parquet")
    except SystemExit as e:
        assert "--prompts" in str(e) and "question" in str(e)
    else:
        raise AssertionError("a jsonl without 'question' was accepted")


def test_reward_is_w05s_through_verls_call():
    texts = ["", "a", "abcdefg", "x" * 13, "héllo wörld", "<|im_end|>", " two words \n"]  # characters, not bytes
    # the naive reward manager calls compute_score(data_source=, solution_str=, ground_truth=, extra_info=)
    got = [V.compute_score(data_source=V.DATA_SOURCE, solution_str=t, ground_truth="0", extra_info={"index": 0})
           for t in texts]
    assert got == [reward("", t, "0") for t in texts] == [0.0, 1.0, 0.0, 6.0, 4.0, 3.0, 5.0]


def test_overrides_carry_w05():
    o = parse_overrides(V.overrides("/m", "/d.parquet", "/out", steps=5))
    a, r = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."
    assert o["algorithm.adv_estimator"] == "grpo" and o["algorithm.norm_adv_by_std_in_grpo"] == "True"
    assert o["algorithm.use_kl_in_reward"] == "False"
    assert int(o[r + "n"]) == W05["group_size"] == 8
    assert int(o["data.train_batch_size"]) == W05["prompts_per_step"] == 64
    # one optimiser step per rollout: verl's mini-batch counts prompts (x n in ray_trainer), one epoch
    assert int(o[a + "ppo_mini_batch_size"]) == int(o["data.train_batch_size"]) and o[a + "ppo_epochs"] == "1"
    assert int(o["data.max_prompt_length"]) == W05["prompt_tokens"] == 256
    assert int(o["data.max_response_length"]) == W05["new_tokens"] == 512
    assert o[r + "ignore_eos"] == "True" and float(o[r + "temperature"]) == 1.0
    assert o[a + "use_kl_loss"] == "True" and float(o[a + "kl_loss_coef"]) == W05["kl_coef"] == 0.04
    assert o[a + "kl_loss_type"] == "low_var_kl"  # k3, as grpo.py's default --kl-estimator
    assert float(o[a + "optim.lr"]) == 1e-6
    assert o[a + "use_dynamic_bsz"] == "True" and int(o[a + "ppo_max_token_len_per_gpu"]) == 16384
    assert o[r + "name"] == "vllm" and o[r + "tensor_model_parallel_size"] == "1"
    assert o[r + "free_cache_engine"] == "True" and float(o[r + "gpu_memory_utilization"]) == 0.35
    assert int(o[r + "max_model_len"]) == 768 and int(o[r + "max_num_seqs"]) == 512
    assert o["actor_rollout_ref.model.use_remove_padding"] == "False"
    assert o["actor_rollout_ref.model.override_config.attn_implementation"] == "sdpa"
    assert o["actor_rollout_ref.model.custom_chat_template"] == f'"{V.CONTENT_ONLY_TEMPLATE}"'
    assert o["actor_rollout_ref.model.path"] == "/m" and o["data.train_files"] == "/d.parquet"
    assert (o["trainer.n_gpus_per_node"], o["trainer.total_training_steps"]) == ("1", "5")
    assert (o["trainer.val_before_train"], o["trainer.test_freq"], o["trainer.save_freq"]) == ("False", "-1", "-1")
    assert o["trainer.logger"] == "[console]" and o["trainer.use_v1"] == "False"
    assert Path(o["reward.custom_reward_function.path"]) == Path(V.__file__).resolve()
    assert callable(getattr(V, o["reward.custom_reward_function.name"]))
    assert parse_overrides(V.overrides("/m", "/d", "/o", 3, nproc=2, trainer="v1"))["trainer.use_v1"] == "True"


def concat_dict_to_str(dict: dict, step):
    """Copy of verl 0.9.1 verl/utils/logger/aggregate_logger.py:concat_dict_to_str, which LocalLogger.log prints
    for trainer.logger=console (the metrics dict of RayPPOTrainer.fit, verl/trainer/ppo/ray_trainer.py)."""
    output = [f"step:{step}"]
    for k, v in dict.items():
        if isinstance(v, numbers.Number):
            output.append(f"{k}:{pprint.pformat(v)}")
    output_str = " - ".join(output)
    return output_str


def verl_step(step: int, step_s: float, gen_s: float) -> dict:
    """Metric names and types as RayPPOTrainer.fit logs them: compute_timing_metrics' timing_s/<phase> (floats from
    codetiming), compute_throughout_metrics' perf/*, the actor's perf/max_memory_allocated_gb, numpy scalars from
    the data metrics, and a non-number that the console logger skips."""
    return {"training/global_step": step, "training/epoch": 0, "actor/pg_loss": np.float64(-0.0123),
            "actor/kl_loss": np.float32(0.0005), "critic/score/mean": np.float64(3.0),
            "response_length/mean": np.float64(512.0), "response_length/clip_ratio": np.float64(1.0),
            "perf/max_memory_allocated_gb": 40.0 + step, "perf/total_num_tokens": 393216,
            "perf/time_per_step": step_s, "perf/throughput": 393216 / step_s, "actor/lr": 1e-06,
            "timing_s/start_profile": 1.2e-05, "timing_s/gen": gen_s, "timing_s/reward": 0.41,
            "timing_s/old_log_prob": 1.9, "timing_s/ref": 1.7, "timing_s/adv": 0.05, "timing_s/update_actor": 6.2,
            "timing_s/update_weights": 0.8, "timing_s/step": step_s, "timing_per_token_ms/gen": 0.031,
            "timing_s/stop_profile": 1e-05, "rollout/is_valid": True, "note": "skipped: not a number"}


def test_parse_console_reads_verls_step_lines():
    lines = ["(TaskRunner pid=2817) TaskRunner hostname: h, PID: 2817",
             "Training Progress:   0%|          | 0/5 [00:00<?, ?it/s]",
             "(TaskRunner pid=2817) " + concat_dict_to_str({"val-core/w05/acc/mean@1": np.float64(0.1)}, step=0)]
    times = [(1, 61.5, 40.0), (2, 24.0, 9.0), (3, 22.0, 8.5), (4, 26.0, 9.5), (5, 23.0, 8.0)]
    lines += ["(TaskRunner pid=2817) " + concat_dict_to_str(verl_step(s, t, g), step=s) for s, t, g in times]
    lines.append("(TaskRunner pid=2817) step:9 - timing_s/step:1.0 trailing")  # its value is not a number: not a step
    rows = V.parse_console("\n".join(lines))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["timing_s/step"] for r in rows] == [61.5, 24.0, 22.0, 26.0, 23.0]
    assert rows[0]["actor/pg_loss"] == -0.0123 and rows[0]["actor/lr"] == 1e-06 and rows[0]["rollout/is_valid"] == 1
    assert abs(rows[0]["actor/kl_loss"] - 0.0005) < 1e-9 and "note" not in rows[0]
    s = V.summarise(rows)
    assert s["steps"] == [61.5, 24.0, 22.0, 26.0, 23.0]
    assert s["median_warm_s"] == 23.5  # steps 2..5, the first step warms up
    assert s["phases"]["gen"] == 8.75 and s["phases"]["update_actor"] == 6.2 and "step" not in s["phases"]
    assert s["peak_mem_gib"] == 45.0 and s["tokens_per_step"] == 512 * 768
    assert s["tokens_per_s_per_gpu"] == 512 * 768 / 23.5 and s["reward_mean"] == [3.0] * 5


def test_child_env_puts_the_verl_site_first(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env = V.child_env("/tmp/verl-site")
    assert env["PYTHONPATH"].split(":") == ["/tmp/verl-site", "/tmp/site", str(V.ROOT)]
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert (env["NCCL_NVLS_ENABLE"], env["VLLM_USE_FLASHINFER_SAMPLER"]) == ("0", "0")


def test_w05_report_lists_the_verl_run(tmp_path, capsys):
    from bench.w05 import report
    runs = [{"name": "build", "ok": True},
            {"name": "grpo-sdpa-1gpu", "kind": "grpo", "nproc": 1, "ok": True, "step_s": 10.0, "attn": "sdpa"},
            {"name": "verl-1gpu", "kind": "verl", "nproc": 1, "ok": True, "steps": [30.0, 20.0], "median_warm_s": 20.0}]
    report({"shape": "0.5b", "runs": runs}, tmp_path)
    out = capsys.readouterr().out
    assert "verl verl-1gpu: ok  steps [30.0, 20.0]  median warm 20.00 s" in out
    assert "grpo-sdpa-1gpu step 10.00 s vs verl-1gpu 20.00 s: 2.00x" in out


def test_ray_programs_without_their_mode_bits_are_made_executable(tmp_path):
    """An unpacked bundle's ray/core/src/ray/gcs/gcs_server had lost +x (one H200, 2026-12-02): ray died at start."""
    prog = tmp_path / "ray" / "core" / "src" / "ray" / "gcs" / "gcs_server"
    prog.parent.mkdir(parents=True)
    prog.write_bytes(b"\x7fELF" + b"\0" * 12)
    prog.chmod(0o644)
    text = tmp_path / "ray" / "__init__.py"
    text.write_text("# not a program\n")
    text.chmod(0o644)
    assert V.make_executable(str(tmp_path)) == ["ray/core/src/ray/gcs/gcs_server"]
    assert os.access(prog, os.X_OK) and not os.access(text, os.X_OK)
    assert V.make_executable(str(tmp_path)) == [] and V.make_executable(None) == []
