"""common/engine_process.py (--vllm.own-process) on CPU with the HF engine: the engine in a child process generates
and refits exactly as in the trainer's process, its errors come back with their traceback, a dead child is named,
and the GPU it gets is the one asked for. grpo_async.py with it: tests/test_grpo_async.py."""
import os
from dataclasses import replace

import pytest
import torch

from common import engine_process as E
from common.rollout import HFEngine
from common.vllm_engine import VLLMArgs

PROMPTS = [[1, 2, 3, 4], [5, 6, 7]]


def sample(engine, seed=3):
    return engine.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=6, seed=seed, logprobs=True)


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    """The same tiny model as an in-process HF engine and as one in a child process."""
    here = HFEngine(str(tiny_model_dir), torch.device("cpu"), pad_token_id=0, eos_token_ids=[])
    there = E.EngineProcess("hf", str(tiny_model_dir), VLLMArgs(), 64, 0, 0, [], None)
    yield here, there
    there.close()


def test_generates_and_refits_as_the_engine_in_process(pair):
    here, there = pair
    assert there._proc.pid != os.getpid() and there._proc.is_alive()
    before = sample(here)
    assert sample(there) == before
    torch.manual_seed(0)
    new = [(n, p.detach() + 0.05 * torch.randn_like(p)) for n, p in here.model.named_parameters()]
    here.load_weights(new)
    there.load_weights(iter(new))  # an iterator, as refit_params gives it; CPU float32 as sent, no cast for HF
    after = sample(here)
    assert after != before  # the refit changed what is sampled
    assert sample(there) == after
    there.sleep(), there.wake(["weights"]), there.wake(["kv_cache"])  # the choreography's calls go through
    assert there.weights_discarded is False and there.resident_hint({}) is None


def test_an_error_in_the_child_comes_back_with_its_traceback_and_the_child_lives_on(pair):
    _, there = pair
    with pytest.raises(RuntimeError, match="(?s)failed in generate.*Traceback.*IndexError"):
        there.generate([[10**9]], n=1, temperature=1.0, max_new_tokens=2, seed=0)  # a token id past the vocabulary
    assert len(sample(there).response_ids) == 4


def test_a_dead_child_is_named(tiny_model_dir):
    there = E.EngineProcess("hf", str(tiny_model_dir), VLLMArgs(), 64, 0, 0, [], None)
    there._proc.kill()
    there._proc.join()
    with pytest.raises(RuntimeError, match="rollout engine's process (is gone|died)"):
        sample(there)
    there.close()  # nothing left to stop: no error


def test_a_child_that_cannot_build_its_engine_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="(?s)failed in start.*Traceback"):
        E.EngineProcess("hf", str(tmp_path / "no-such-model"), VLLMArgs(), 64, 0, 0, [], None)


def test_the_child_gets_the_gpu_asked_for(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert E.child_gpu(-1, 1) == "5" and E.child_gpu(-1, 0) == "3"  # the rank's own
    assert E.child_gpu(1, 0) == "5"  # the other GPU: engine on one, trainer on the other
    with pytest.raises(ValueError, match="engine-gpu 2: this rank sees 2 GPU"):
        E.child_gpu(2, 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert E.child_gpu(1, 0) == "1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert E.child_gpu(1, 0) is None


def test_tensor_parallel_engines_are_refused():
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        E.EngineProcess("vllm", "m", replace(VLLMArgs(), tensor_parallel_size=2), 64, 0, 0, [], None)


def test_an_engine_gpu_without_its_own_process_is_refused():
    with pytest.raises(ValueError, match="engine-gpu 1 places the engine's own process: add --vllm.own-process"):
        E.check_engine_args(replace(VLLMArgs(), engine_gpu=1))
    E.check_engine_args(replace(VLLMArgs(), engine_gpu=1, own_process=True))
    E.check_engine_args(VLLMArgs())
