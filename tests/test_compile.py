"""common/fsdp.py's options: --fsdp.compile (compiled decoder layers give the eager log-probs and gradients; CPU
through inductor's C++ backend in CI, CUDA with the varlen kernel and bf16 under -m gpu) and
--fsdp.reshard-after-forward and --fsdp.unit (no stale gathered parameters after an optimiser step)."""
import os

import pytest
import torch

from conftest import ROOT, torchrun


def run_driver(model_dir, tmp_path, device: str, driver: str = "tests/compile_driver.py") -> dict:
    """Run a driver as a world of one under torchrun (a process group of its own) and load what it saved."""
    out = tmp_path / "res.pt"
    path = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])  # keep a GPU site dir
    torchrun(driver, str(model_dir), str(out), device, nproc=1, timeout=900,
             env={"PYTHONPATH": path, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    return torch.load(out)


def check(res: dict, atol: float, rtol: float) -> None:
    eager = res["eager"]
    assert any(g.abs().sum() > 0 for g in eager["grads"].values())
    for name in ("compiled", "compiled_ckpt"):
        for a, b in zip(res[name]["logp"], eager["logp"]):
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
        assert res[name]["grads"].keys() == eager["grads"].keys()  # compiling must not rename parameters
        for k, g in eager["grads"].items():
            scale = float(g.abs().max()) or 1.0
            torch.testing.assert_close(res[name]["grads"][k] / scale, g / scale, atol=atol, rtol=rtol,
                                       msg=lambda m: f"{name}: {k}: {m}")


@pytest.mark.slow
def test_compiled_layers_match_eager(tiny_model_dir, tmp_path):
    check(run_driver(tiny_model_dir, tmp_path, "cpu"), atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
def test_compiled_layers_match_eager_cuda(tiny_model_dir, tmp_path):
    """bf16 compute: compiled and eager differ by rounding only (fused kernels keep fp32 intermediates)."""
    check(run_driver(tiny_model_dir, tmp_path, "cuda"), atol=3e-2, rtol=3e-2)


@pytest.fixture(scope="module")
def fsdp_results(tiny_model_dir, tmp_path_factory) -> dict:
    """One run of tests/fsdp_driver.py (a world of one): what the two tests below read."""
    return run_driver(tiny_model_dir, tmp_path_factory.mktemp("fsdp"), "cpu", "tests/fsdp_driver.py")


def test_no_stale_parameters_without_resharding_after_forward(fsdp_results):
    """With reshard_after_forward=False every layer stays gathered after a no-grad pass, and with the whole model
    as one unit (--fsdp.unit model, the default with one rank) the root does; common.fsdp.reshard must free them
    before the optimiser step, or the next pass would compute with the old weights. Same log-probs in all three."""
    res = fsdp_results
    torch.testing.assert_close(res["layer_noraf"], res["layer"], atol=1e-6, rtol=0)
    torch.testing.assert_close(res["model"], res["layer"], atol=1e-6, rtol=0)
    assert res["layer_units"] == 2 + 1  # the tiny model's two decoder layers and the root
    assert res["model_units"] == 1  # auto with one rank: the whole model


def test_fsdp_unit_auto():
    from common.fsdp import FSDPArgs, resolve_unit
    assert resolve_unit(FSDPArgs(), 1, False) == "model"
    assert resolve_unit(FSDPArgs(), 2, False) == "layer"
    assert resolve_unit(FSDPArgs(), 2, True) == "model"  # gathered once per mini-batch: per-layer units only cost
    assert resolve_unit(FSDPArgs(cpu_offload=True), 1, False) == "layer"  # offload moves one unit at a time
    assert resolve_unit(FSDPArgs(cpu_offload=True, keep_gathered="on"), 2, True) == "layer"
    assert resolve_unit(FSDPArgs(unit="layer"), 1, True) == "layer"
    assert resolve_unit(FSDPArgs(unit="model"), 8, False) == "model"


def test_fsdp_keep_gathered_auto(monkeypatch):
    """auto keeps the gathered model between micro-batches when its copy is under 5 % of the GPU's memory."""
    from types import SimpleNamespace

    from common.fsdp import FSDPArgs, resolve_keep_gathered
    model = torch.nn.Linear(1000, 1000)  # ~1M parameters: 2 MB gathered in bf16
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: SimpleNamespace(total_memory=int(2e6 / 0.05) + 10**6))
    assert resolve_keep_gathered(FSDPArgs(), model, cuda)
    assert not resolve_keep_gathered(FSDPArgs(param_dtype="float32"), model, cuda)  # 4 MB: over 5 %
    assert not resolve_keep_gathered(FSDPArgs(cpu_offload=True), model, cuda)
    assert not resolve_keep_gathered(FSDPArgs(), model, cpu)
    assert resolve_keep_gathered(FSDPArgs(keep_gathered="on"), model, cpu)
    assert not resolve_keep_gathered(FSDPArgs(keep_gathered="off"), model, cuda)


def test_frozen_reference_stored_in_compute_dtype(fsdp_results):
    """shard() keeps a frozen model's parameters in the forward's dtype (no fp32 master copy): same log-probs as
    fp32 storage cast by mixed precision; buffers (RoPE's inv_freq) keep their dtype."""
    frozen = fsdp_results["frozen"]
    assert frozen["bfloat16_param_dtypes"] == ["torch.bfloat16"]
    assert frozen["float32_param_dtypes"] == ["torch.float32"]
    assert frozen["bfloat16_buffer_dtypes"] == frozen["float32_buffer_dtypes"] == ["torch.float32"]
    torch.testing.assert_close(frozen["bfloat16"], frozen["float32"], atol=0, rtol=0)
