"""wandb in offline mode: the run's config (every flag and the git commit), its metric history and the samples
table are in the local run file; --resume continues the same wandb run (its id is kept in the run folder) and a
fresh run in another folder gets a new one. The .wandb file is read with wandb's own protobuf records."""
import dataclasses
import json
import os
import struct
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.fixture(scope="module")
def tiny(tiny_smollm):
    return tiny_smollm  # conftest's, made once per session


def wandb_records(path):
    """The records of a .wandb file: LevelDB-log framing (32 KiB blocks, 7-byte chunk headers) of wandb.proto Records
    (wandb 0.31 ships no Python reader of it any more)."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = path.read_bytes()
    assert struct.unpack("<4sH", data[:6]) == (b":W&B", 0xBEE1), data[:7]
    pos, chunk = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the zero padding at the end of a block
            pos += left
            continue
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a record is complete
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def grpo(tiny, out, name, *extra, check=True):
    cmd = [sys.executable, "grpo.py", "--model", str(tiny), "--reward-fn", "tests.toy_reward:letters",
           "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-every", "0",
           "--log-samples-every", "1", "--out-dir", str(out), "--exp-name", name, "--track", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_DIR": str(out / "wandb_dir")}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert not check or p.returncode == 0, p.stdout[-3000:] + p.stderr[-4000:]
    return p


def run_file(run_dir, run_id):
    files = sorted((run_dir / "wandb").glob(f"*-{run_id}/run-{run_id}.wandb"))
    assert files, sorted(p.name for p in (run_dir / "wandb").iterdir())
    return files


@pytest.mark.slow
def test_offline_run_records_config_history_samples_and_resumes_the_same_run(tiny, tmp_path):
    run_dir = tmp_path / "a"
    grpo(tiny, tmp_path, "a", "--num-steps", "2", "--save-every", "1")
    run_id = (run_dir / "wandb_id.txt").read_text().strip()
    records = list(wandb_records(run_file(run_dir, run_id)[0]))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.run_id == run_id and run.display_name == "a"
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    local = json.loads((run_dir / "config.json").read_text())
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert config["git_sha"] == git and len(git) == 40
    from grpo import Args
    flags = [f.name for f in dataclasses.fields(Args)]
    assert {"lr", "group_size", "kl_coef", "vllm", "fsdp"} <= set(flags)
    for key in flags + ["world_size", "model_path", "argv"]:  # every flag and the run's derived facts
        assert config[key] == local[key], key
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = history.setdefault(r.history.step.num, {})
            row.update({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
    assert sorted(history) == [0, 1]
    metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:  # the history holds what metrics.jsonl holds, step by step
        assert history[m["step"]]["train/loss"] == pytest.approx(m["train/loss"])
        assert history[m["step"]]["reward/mean"] == pytest.approx(m["reward/mean"])
        table = history[m["step"]]["samples/path"]  # the samples table: a table file in the run's files
        assert history[m["step"]]["samples/_type"] == "table-file" and history[m["step"]]["samples/nrows"] == 4
        rows = json.loads((run_file(run_dir, run_id)[0].parent / "files" / table).read_text())
        assert rows["columns"] == ["prompt", "completion", "answer", "reward"] and len(rows["data"]) == 4

    # --resume continues the same wandb run (resumed from step 1: step 1 is logged again, then step 2)
    p = grpo(tiny, tmp_path, "a", "--num-steps", "3", "--resume", str(run_dir / "checkpoints" / "step_000001"))
    assert "resumed from" in p.stdout and "at step 1" in p.stdout
    assert (run_dir / "wandb_id.txt").read_text().strip() == run_id
    second = run_file(run_dir, run_id)
    assert len(second) == 2, second  # two sessions of one wandb run, and no other run id in the folder
    assert len(list((run_dir / "wandb").glob("*run-*"))) == 2
    steps = [r.history.step.num for r in wandb_records(second[-1]) if r.WhichOneof("record_type") == "history"]
    assert steps == [1, 2]

    # a fresh run in a new folder with the same name is a new wandb run
    (tmp_path / "other").mkdir()
    grpo(tiny, tmp_path / "other", "a", "--num-steps", "1")
    other = (tmp_path / "other" / "a" / "wandb_id.txt").read_text().strip()
    assert other != run_id and run_file(tmp_path / "other" / "a", other)
