"""LoRA (--lora.*, common/lora.py): only the adapters train and sit in the optimiser while FSDP2 shards base and
adapters alike; the reference (adapters disabled) is the base model; the merged refit stream is peft's
merge_and_unload; both --export-hf folders load in transformers with the policy's log-probs; checkpoints hold the
adapters and resume exactly (sft.py, dpo.py); --lora.rank 0 changes nothing."""
import json
from pathlib import Path

import pytest
import torch

from conftest import ROOT, torchrun

from common import checkpoint as C
from common import lora
from common.fsdp import FSDPArgs, iter_full_params
from common.models import TokenLogProbs, load_causal_lm

GSM8K = ROOT / "tests" / "data" / "gsm8k_tiny.jsonl"


def run_driver(model_dir: Path, out: Path, param_dtype: str) -> dict:
    out.mkdir(parents=True)
    torchrun("tests/lora_driver.py", str(model_dir), str(out), param_dtype)
    return torch.load(out / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def fp32(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "fp32"
    return out, run_driver(tiny_model_dir, out, "float32")


def logp_of(model, mb) -> torch.Tensor:
    with torch.no_grad():
        return TokenLogProbs(model, "torch")(mb["input_ids"], mb["position_ids"], mb["targets"])[0]


@pytest.mark.slow
def test_only_adapters_train_and_everything_is_sharded(fp32):
    _, r = fp32
    params = r["params"]
    adapters = {n for n in params if ".lora_A." in n or ".lora_B." in n}
    assert adapters and {n for n, p in params.items() if p["trainable"]} == adapters
    assert all(p["sharded"] for p in params.values())  # FSDP2 shards the frozen base and the adapters
    assert r["optimiser_params"] == r["optimiser_state"] == len(adapters)  # AdamW holds the adapters only
    for step in (0, 1):
        grads = r[f"grads_{step}"]
        assert all(grads[n] is None for n in params if n not in adapters)  # no gradient reaches the base
        assert all(grads[n] is not None for n in adapters)
    # B starts at 0, so A's first gradient is 0; after one step every adapter gets a gradient
    assert all(r["grads_0"][n] > 0 for n in adapters if ".lora_B." in n)
    assert all(r["grads_1"][n] > 0 for n in adapters)
    assert r["checkpoint_keys"] == sorted(adapters)  # a checkpoint holds what trains


@pytest.mark.slow
def test_reference_is_the_base_model(fp32):
    _, r = fp32
    torch.testing.assert_close(r["ref_logp"], r["base_logp"], rtol=0, atol=1e-6)
    assert (r["policy_logp"] - r["base_logp"]).abs().max() > 1e-2  # the adapters trained: the policy moved away
    assert torch.equal(r["policy_logp_after_ref"], r["policy_logp"])  # and they are back on after the reference


@pytest.mark.slow
def test_merged_refit_stream_is_peft_merge_and_unload(fp32, tiny_model_dir):
    from peft import get_peft_model, set_peft_model_state_dict
    _, r = fp32
    base = load_causal_lm(str(tiny_model_dir))
    peft_model = get_peft_model(base, lora.peft_config(lora.LoraArgs(rank=4, alpha=8.0)))
    adapters = {k.removeprefix("base_model.model."): v for k, v in r["adapters"].items()}
    result = set_peft_model_state_dict(peft_model, {"base_model.model." + k: v for k, v in adapters.items()})
    assert not result.unexpected_keys
    want = {k: v for k, v in peft_model.merge_and_unload().state_dict().items() if k != "lm_head.weight"}  # tied
    assert set(r["merged"]) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(r["merged"][k], v, rtol=1e-6, atol=1e-7, msg=k)
    init = load_causal_lm(str(tiny_model_dir)).state_dict()
    moved = [k for k in want if not torch.equal(want[k], init[k])]
    assert len(moved) == 14  # every adapted linear layer (7 per layer, 2 layers) changed; nothing else


@pytest.mark.slow
def test_exports_load_in_transformers_with_the_policys_logprobs(fp32):
    from transformers import AutoModelForCausalLM
    out, r = fp32
    merged, info = AutoModelForCausalLM.from_pretrained(out / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    adapter = AutoModelForCausalLM.from_pretrained(out / "adapter")  # peft installed: base + adapter
    assert lora.enabled(adapter)
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == 4
    for model in (merged, adapter):
        torch.testing.assert_close(logp_of(model.float().eval(), r["mb"]), r["policy_logp"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_bf16_base_trains_and_the_reference_is_the_base(tiny_model_dir, tmp_path):
    r = run_driver(tiny_model_dir, tmp_path / "bf16", "bfloat16")
    dtypes = {n: p["dtype"] for n, p in r["params"].items()}
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {"torch.bfloat16"}  # the frozen base: half the bytes
    assert {d for n, d in dtypes.items() if "lora_" in n} == {"torch.float32"}  # what the optimiser updates
    assert all(r["grads_1"][n] > 0 for n in dtypes if "lora_" in n)
    torch.testing.assert_close(r["ref_logp"], r["base_logp"], rtol=0, atol=1e-6)


def test_rank_0_is_off(tiny_model_dir):
    lm = load_causal_lm(str(tiny_model_dir))
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    assert lora.apply(lm, lora.LoraArgs(), FSDPArgs(param_dtype="bfloat16"), torch.device("cpu"), 1) is lm
    after = lm.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) and after[k].dtype == v.dtype
                                                   for k, v in before.items())
    assert not lora.enabled(lm) and lora.trainable(lm) == list(lm.parameters())
    assert not C._frozen(lm)  # a checkpoint holds every parameter, as before
    assert [n for n, _ in lora.refit_params(lm, "")] == [n for n, _ in iter_full_params(lm, "")]


def test_bad_lora_flags_are_named(tiny_model_dir):
    for bad, flag in ((dict(rank=-1), "--lora.rank"), (dict(rank=4, alpha=0.0), "--lora.alpha"),
                      (dict(rank=4, dropout=1.0), "--lora.dropout"),
                      (dict(merge_on_export=True), "--lora.merge-on-export without --lora.rank")):
        with pytest.raises(ValueError, match=flag):
            lora.check(lora.LoraArgs(**bad))
    with pytest.raises(ValueError, match="--lora.target-modules no_such_proj"):
        lora.apply(load_causal_lm(str(tiny_model_dir)), lora.LoraArgs(rank=4, target_modules=("no_such_proj",)),
                   FSDPArgs(), torch.device("cpu"), 1)


# ---- end to end ---------------------------------------------------------------------------------------------
def metrics(run_dir: Path, key: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def saved_keys(ckpt: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader
    return [k for k in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if k.startswith("policy.model.")]


@pytest.mark.slow
def test_sft_lora_resumes_exactly_and_exports_adapters(tiny_model_dir, tmp_path):
    """--deterministic, seed 1: the adapters learn (train loss of step 3 below step 0's; over seeds 1-3 on a 2-core
    CPU, 2026-12-06, it fell 0.161, 0.156, 0.157 from 10.77), the checkpoint holds the adapters only, resume is exact
    and the export is an adapter folder."""
    base = ["--model", str(tiny_model_dir), "--dataset", str(GSM8K), "--sequences-per-step", "8", "--num-steps", "4",
            "--eval-fraction", "0.2", "--max-tokens-per-microbatch", "512", "--max-length", "256", "--lr", "1e-2",
            "--deterministic", "--save-every", "2", "--eval-every", "0", "--lora.rank", "4", "--lora.alpha", "8"]
    torchrun("sft.py", *base, "--out-dir", str(tmp_path / "full"), "--export-hf", str(tmp_path / "hf"))
    ckpt2 = tmp_path / "full" / "sft" / "checkpoints" / "step_000002"
    keys = saved_keys(ckpt2)
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)  # the adapters only, not the base
    torchrun("sft.py", *base, "--out-dir", str(tmp_path / "resumed"), "--resume", str(ckpt2))
    full, resumed = (metrics(tmp_path / k / "sft", "train/loss") for k in ("full", "resumed"))
    assert sorted(full) == [0, 1, 2, 3] and sorted(resumed) == [2, 3]
    assert full[3] < full[0]  # the adapters learn
    assert [resumed[s] for s in (2, 3)] == [full[s] for s in (2, 3)]
    assert (tmp_path / "hf" / "adapter_model.safetensors").is_file()
    with pytest.raises(C.CheckpointError, match="LoRA run"):  # tools/export.py names what to do instead
        C.load_for_export(ckpt2, str(tiny_model_dir))


@pytest.mark.slow
def test_dpo_lora_live_reference_is_the_base_and_resumes_exactly(tiny_model_dir, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "chosen": f"It is {2 * i}.",
                                        "rejected": "No idea" + "!" * (i % 5)}) + "\n" for i in range(24)))
    base = ["--model", str(tiny_model_dir), "--dataset", str(data), "--pairs-per-step", "4", "--eval-fraction", "0.25",
            "--eval-every", "0", "--max-length", "64", "--max-tokens-per-microbatch", "128", "--lr", "1e-2",
            "--cache-dir", str(tmp_path / "ref_cache"), "--num-steps", "4", "--save-every", "2", "--deterministic",
            "--lora.rank", "4", "--lora.merge-on-export"]
    torchrun("dpo.py", *base, "--out-dir", str(tmp_path / "cached"), "--export-hf", str(tmp_path / "hf"))
    torchrun("dpo.py", *base, "--out-dir", str(tmp_path / "live"), "--no-ref-cache")  # pi_ref: adapters disabled
    torchrun("dpo.py", *base, "--out-dir", str(tmp_path / "resumed"),
             "--resume", str(tmp_path / "cached" / "dpo" / "checkpoints" / "step_000002"))
    cached, live = (metrics(tmp_path / k / "dpo", "train/loss") for k in ("cached", "live"))
    resumed = metrics(tmp_path / "resumed" / "dpo", "train/loss")
    assert sorted(cached) == [0, 1, 2, 3] and cached[3] < cached[0]
    assert live == pytest.approx(cached, rel=1e-6)  # the cached table came from the same base model
    assert [resumed[s] for s in (2, 3)] == [cached[s] for s in (2, 3)]
    from common.models import resolve_model  # the merged export is an ordinary --model folder
    assert resolve_model(str(tmp_path / "hf")) == str(tmp_path / "hf")


def comparable(run_dir: Path) -> dict[int, dict]:
    """Each step's training row without timings."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith("perf/") and k != "time"}
            for r in rows if "train/loss" in r}


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo.py", "ppo.py"])
def test_rl_lora_with_kl_resumes_exactly(script, tiny_model_dir, tmp_path):
    """grpo.py / ppo.py with LoRA and a KL term (the reference: the base, adapters off): 4 steps straight == 2 steps,
    then resumed from the checkpoint to 4; the checkpoint holds the policy's adapters (and PPO's whole critic)."""
    args = ["--model", str(tiny_model_dir), "--reward-fn", "tests.toy_reward:letters", "--max-new-tokens", "6",
            "--lr", "1e-2", "--top-k", "10", "--eval-every", "0", "--num-minibatches", "2", "--kl-coef", "0.1",
            "--num-steps", "4", "--save-every", "2", "--deterministic", "--lora.rank", "4", "--lora.merge-on-export"]
    args += ["--prompts-per-step", "2", "--group-size", "4"] if script == "grpo.py" else \
        ["--prompts-per-step", "4", "--critic-lr", "1e-2", "--num-epochs", "1"]
    name = script.removesuffix(".py")
    p = torchrun(script, *args, "--out-dir", str(tmp_path / "straight"), "--export-hf", str(tmp_path / "hf"))
    assert "the base (LoRA off)" in p.stdout  # the reference row of the geometry table
    ckpt = tmp_path / "straight" / name / "checkpoints" / "step_000002"
    policy_keys = saved_keys(ckpt)  # policy.model.* only (PPO's critic is critic.model.*)
    assert policy_keys and all(".lora_A." in k or ".lora_B." in k for k in policy_keys)
    torchrun(script, *args, "--out-dir", str(tmp_path / "resumed"), "--resume", str(ckpt))
    straight, resumed = comparable(tmp_path / "straight" / name), comparable(tmp_path / "resumed" / name)
    assert sorted(straight) == [0, 1, 2, 3] and sorted(resumed) == [2, 3]
    assert max(straight[s]["train/kl"] for s in straight) > 1e-4  # the adapters moved the policy off the base
    assert [resumed[s] for s in (2, 3)] == [straight[s] for s in (2, 3)]
    if script == "grpo.py":  # the merged export is an ordinary model: grpo.py trains from it
        torchrun(script, "--model", str(tmp_path / "hf"), "--reward-fn", "tests.toy_reward:letters", "--num-steps", "1",
                 "--max-new-tokens", "6", "--prompts-per-step", "2", "--group-size", "4", "--eval-every", "0",
                 "--out-dir", str(tmp_path / "from_merged"))


def test_dropout_only_where_gradients_flow(tiny_model_dir):
    """--lora.dropout: forwards with gradients draw dropout masks; no-grad passes (pi_old in grpo.py/ppo.py, which
    run the policy in train mode) are deterministic and equal the eval-mode forward."""
    lm = lora.apply(load_causal_lm(str(tiny_model_dir)), lora.LoraArgs(rank=4, dropout=0.5), FSDPArgs(),
                    torch.device("cpu"), 1)
    for n, p in lm.named_parameters():
        if ".lora_B." in n:
            torch.nn.init.normal_(p)  # B = 0 would hide the adapters (and their dropout)
    ids = torch.arange(1, 9).view(1, -1)
    run = lambda: lm(input_ids=ids).logits
    lm.train()
    with torch.no_grad():
        a, b = run(), run()
    assert torch.equal(a, b)
    assert not torch.equal(run().detach(), run().detach())  # with gradients: two dropout draws
    lm.eval()
    assert torch.equal(run().detach(), a)
