"""common/fsdp.py's --fsdp.compile: compiled decoder layers give the eager log-probs and gradients (CPU, inductor)."""
import sys

import pytest
import torch

from conftest import ROOT


@pytest.mark.slow
def test_compiled_layers_match_eager(tiny_model_dir, tmp_path):
    import subprocess
    out = tmp_path / "res.pt"
    p = subprocess.run([sys.executable, "tests/compile_driver.py", str(tiny_model_dir), str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=900,
                       env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin",
                            "HOME": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert p.returncode == 0, p.stderr[-4000:]
    res = torch.load(out)
    eager = res["eager"]
    assert any(g.abs().sum() > 0 for g in eager["grads"].values())
    for name in ("compiled", "compiled_ckpt"):
        for a, b in zip(res[name]["logp"], eager["logp"]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert res[name]["grads"].keys() == eager["grads"].keys()  # compiling must not rename parameters
        for k, g in eager["grads"].items():
            torch.testing.assert_close(res[name]["grads"][k], g, atol=1e-5, rtol=1e-4, msg=f"{name}: {k}")
