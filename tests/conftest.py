"""Shared fixtures: a real tokenizer (Qwen2.5's, shipped in ../shared/gpu) and tiny models built from a config."""
import os
import subprocess
import sys
import tarfile
from pathlib import Path

# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before triton is first imported.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
QWEN_TOKENIZER_TAR = Path(os.environ.get("QWEN_TOKENIZER_TAR", SHARED / "gpu" / "qwen2.5-tokenizer.tar.xz"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run with -m gpu on the GPU machine)")
    config.addinivalue_line("markers", "slow: end-to-end runs that take tens of seconds")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory) -> Path:
    if not QWEN_TOKENIZER_TAR.exists():
        pytest.skip(f"{QWEN_TOKENIZER_TAR} not found")
    out = tmp_path_factory.mktemp("tok")
    with tarfile.open(QWEN_TOKENIZER_TAR) as t:
        t.extractall(out, filter="data")
    return next(p.parent for p in out.rglob("tokenizer.json"))


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir)


def make_tiny_model(path: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A 2-layer Qwen2 with the real Qwen2.5 tokenizer, saved as an HF folder (random weights)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=2048,
               tie_word_embeddings=True, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
               pad_token_id=tok.pad_token_id)
    cfg.update(overrides)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(Qwen2Config(**cfg)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, qwen_tokenizer_dir) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", qwen_tokenizer_dir)


def torchrun(script: str, *args: str, nproc: int = 2, timeout: int = 600, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run a script of the repo under torchrun on CPU (gloo) and return the finished process."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           script, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
                "WANDB_MODE": "disabled", **(env or {})}
    p = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}")
    return p
