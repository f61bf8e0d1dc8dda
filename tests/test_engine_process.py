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


def resolved() -> VLLMArgs:
    """VLLMArgs with its engine count resolved (one): EngineProcess takes a count, not the default 0 (auto), which
    common/rl_setup.py resolves."""
    return VLLMArgs(num_engines=1)


def sample(engine, seed=3):
    return engine.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=6, seed=seed, logprobs=True)


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    """The same tiny model as an in-process HF engine and as one in a child process."""
    here = HFEngine(str(tiny_model_dir), torch.device("cpu"), pad_token_id=0, eos_token_ids=[])
    there = E.EngineProcess("hf", str(tiny_model_dir), resolved(), 64, 0, 0, [], None)
    yield here, there
    there.close()


def test_generates_and_refits_as_the_engine_in_process(pair):
    here, there = pair
    assert there._procs[0].pid != os.getpid() and there._procs[0].is_alive()
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


def test_waking_an_engine_on_the_trainer_s_gpu_hands_torch_s_cached_blocks_back_first(pair, monkeypatch):
    """The update's cached activations would stay reserved in the trainer while the children map their weights and KV
    cache beside them (W05 on one H200, 2026-12-02: whole-GPU peak 58 GiB with 4 engines). Only for the trainer's own
    GPU, and only while the engine sleeps, as the child reports it: an awake engine's wake (grpo_async.py's, every step;
    any at sleep level 0, whose VLLMEngine.sleep keeps everything) keeps the trainer's cache."""
    from common.vllm_engine import VLLMEngine
    _, there = pair
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    there.sleep()
    assert there.asleep  # the child's state, copied back
    there.wake(["weights"])
    assert calls == [] and not there.asleep  # the child is not on the trainer's GPU (CPU here); HF wakes it all
    monkeypatch.setattr(there, "_same_gpu", True)
    there.wake(["weights"]), there.wake(["kv_cache"])  # awake: nothing to hand back
    assert calls == []
    there.sleep(), there.wake(["weights"]), there.wake(["kv_cache"])
    assert calls == [1]
    vllm = VLLMEngine.__new__(VLLMEngine)  # what the vLLM child reports: asleep while any part sleeps
    for parts, asleep in ((set(), False), ({"kv_cache"}, True), ({"weights", "kv_cache"}, True)):
        vllm._asleep = parts
        assert vllm.asleep is asleep


def test_a_profiled_step_has_the_child_profile_its_next_generate_once(pair, tmp_path):
    """--profile-step with the engine in its own process: the trainer's profiler does not see the child's kernels, so
    Profile(engine=...) has the child profile its next generate, made on whichever thread (grpo_async.py: the
    background one), into <path>_engine.txt; the call after is not profiled, a Profile that is off asks nothing, and
    what is sampled does not change."""
    from concurrent.futures import ThreadPoolExecutor

    from common.tracking import Profile
    _, there = pair
    before = sample(there)
    Profile(False, tmp_path / "off", engine=there)
    sample(there)
    assert list(tmp_path.iterdir()) == []
    prof = Profile(True, tmp_path / "p", trace=False, engine=there)
    with ThreadPoolExecutor(max_workers=1) as pool:
        assert pool.submit(sample, there).result() == before
    prof.stop(True)
    table = (tmp_path / "p_engine.txt").read_text()
    assert "Self CPU" in table and "aten::" in table  # the child's own torch.profiler table of its generate
    (tmp_path / "p_engine.txt").unlink()
    assert sample(there) == before and not (tmp_path / "p_engine.txt").exists()


def test_an_error_in_the_child_comes_back_with_its_traceback_and_the_child_lives_on(pair):
    _, there = pair
    with pytest.raises(RuntimeError, match="(?s)failed in generate.*Traceback.*IndexError"):
        there.generate([[10**9]], n=1, temperature=1.0, max_new_tokens=2, seed=0)  # a token id past the vocabulary
    assert len(sample(there).response_ids) == 4


def test_a_dead_child_is_named(tiny_model_dir):
    there = E.EngineProcess("hf", str(tiny_model_dir), resolved(), 64, 0, 0, [], None)
    there._procs[0].kill()
    there._procs[0].join()
    with pytest.raises(RuntimeError, match="rollout engine's process (is gone|died)"):
        sample(there)
    there.close()  # nothing left to stop: no error


def test_a_refit_the_trainer_abandons_midway_does_not_hold_up_the_close(tiny_model_dir):
    """The trainer fails while making the refit's buckets (an FSDP gather, say) and exits: close() must not wait its
    60 s for a child still waiting for the next bucket; the child takes the close and stops."""
    import time
    there = E.EngineProcess("hf", str(tiny_model_dir), replace(resolved(), refit_bucket_mb=0), 64, 0, 0, [], None)

    def failing():
        here = HFEngine(str(tiny_model_dir), torch.device("cpu"), pad_token_id=0, eos_token_ids=[])
        for i, (n, p) in enumerate(here.model.named_parameters()):
            if i == 2:
                raise RuntimeError("the gather failed")
            yield n, p.detach()
    with pytest.raises(RuntimeError, match="the gather failed"):
        there.load_weights(failing())
    t0 = time.perf_counter()
    there.close()
    assert time.perf_counter() - t0 < 20 and there._procs[0].exitcode == 0


def test_a_child_that_cannot_build_its_engine_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="(?s)failed in start.*Traceback"):
        E.EngineProcess("hf", str(tmp_path / "no-such-model"), resolved(), 64, 0, 0, [], None)


def test_the_child_gets_the_gpu_asked_for(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert E.child_gpu(-1, 1) == 1 and E.child_gpu(-1, 0) == 0  # the rank's own
    assert E.child_gpu(1, 0) == 1  # the other GPU: engine on one, trainer on the other
    with pytest.raises(ValueError, match="engine-gpu 2: this rank sees 2 GPU"):
        E.child_gpu(2, 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert E.child_gpu(1, 0) is None


def test_a_world_of_one_keeps_the_local_rank_it_is_given():
    """The engine's process is a world of one on the trainer's GPU numbering: common.dist must keep the LOCAL_RANK
    _serve sets (it used to force 0), and still default to 0."""
    import os
    import torch.distributed as dist
    from common import dist as D
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    saved = dict(os.environ)  # init_distributed sets RANK, WORLD_SIZE, ...: none may outlive the test (subprocesses)
    try:
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(k, None)
        os.environ["LOCAL_RANK"] = "3"
        d = D.init_distributed("cpu")
        try:
            assert (d.rank, d.world_size, d.local_rank) == (0, 1, 3)
        finally:
            D.cleanup()
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(k, None)
        d = D.init_distributed("cpu")
        try:
            assert d.local_rank == 0
        finally:
            D.cleanup()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_a_refit_is_one_engine_call_fed_bucket_by_bucket(tiny_model_dir):
    """The child hands the whole refit to ONE engine.load_weights (vLLM checks there that every parameter came), the
    parent making a bucket only after the child took the last: with buckets of ~1 tensor, many round trips."""
    there = E.EngineProcess("hf", str(tiny_model_dir), replace(resolved(), refit_bucket_mb=0), 64, 0, 0, [], None)
    try:
        assert there.refit_via == "cpu"  # no GPU here: CPU tensors in shared memory
        sent = []

        def named():
            here = HFEngine(str(tiny_model_dir), torch.device("cpu"), pad_token_id=0, eos_token_ids=[])
            for n, p in here.model.named_parameters():
                sent.append(n)
                yield n, p.detach() * 0  # all zeros: every logit equal after the refit
        there.load_weights(named())
        assert len(sent) > 3
        # zero weights: every response log-prob is the uniform one, so the refit took all of them
        r = sample(there)
        vocab = HFEngine(str(tiny_model_dir), torch.device("cpu"), pad_token_id=0, eos_token_ids=[]).model.config.vocab_size
        flat = [x for lp in r.logprobs for x in lp]
        assert flat and max(abs(x + torch.log(torch.tensor(float(vocab))).item()) for x in flat) < 1e-4
        assert sample(there).response_ids == r.response_ids  # the pipe is in step after the refit
    finally:
        there.close()


def test_tensor_parallel_engines_are_refused():
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        E.EngineProcess("vllm", "m", replace(resolved(), tensor_parallel_size=2), 64, 0, 0, [], None)


def test_an_engine_gpu_without_its_own_process_is_refused():
    with pytest.raises(ValueError, match="engine-gpu 1 places the engine's own process: add --vllm.own-process"):
        E.check_engine_args(replace(resolved(), engine_gpu=1))
    E.check_engine_args(replace(resolved(), engine_gpu=1, own_process=True))
    E.check_engine_args(VLLMArgs())


def test_a_batch_is_cut_into_contiguous_shares_as_even_as_possible():
    assert E.shares(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert E.shares(2, 3) == [(0, 1), (1, 2), (2, 2)]
    assert E.shares(512, 4) == [(0, 128), (128, 256), (256, 384), (384, 512)]


def test_a_share_of_a_batch_gets_the_request_seeds_it_has_in_the_whole_batch():
    from common.vllm_engine import request_seeds
    whole = request_seeds(5, 0, 64, 8)
    assert request_seeds(5, 0, 24, 8, first=40) == whole[40:] and request_seeds(5, 0, 40, 8) == whole[:40]
    with pytest.raises(ValueError, match="out of range"):
        request_seeds(5, 0, 10, 8, first=-1)


@pytest.mark.slow  # several engine processes (tests/README.md, rule 4)
def test_several_engines_split_the_prompts_refit_together_and_answer_in_order(tiny_model_dir, tmp_path):
    """--vllm.num-engines 2: each child generates a contiguous share, told its place in the batch (first_request:
    vLLM's request seeds follow it; the HF engine draws from a stream of its own), the rollout keeps the prompts'
    order, one refit reaches both, and each child gets half of the batch and memory limits."""
    args = replace(resolved(), num_engines=2, max_num_seqs=5, gpu_memory_utilization=0.3, refit_bucket_mb=0)
    one = E.EngineProcess("hf", str(tiny_model_dir), resolved(), 64, 0, 0, [], None)
    two = E.EngineProcess("hf", str(tiny_model_dir), args, 64, 0, 0, [], None)
    try:
        assert len(two._procs) == 2 and len({p.pid for p in two._procs}) == 2
        prompts = PROMPTS + [[8, 9], [10, 11, 12]]  # shares of 2 and 2
        r1 = one.generate(prompts, n=2, temperature=1.0, max_new_tokens=6, seed=3, logprobs=True)
        r2 = two.generate(prompts, n=2, temperature=1.0, max_new_tokens=6, seed=3, logprobs=True)
        assert r2.prompt_ids == r1.prompt_ids == [p for p in prompts for _ in range(2)]
        assert len(r2.response_ids) == len(r2.logprobs) == len(r2.finish_reasons) == 8
        # each share is what one engine gives for it, told where it starts in the batch (request seeds: vLLM)
        kw = dict(n=2, temperature=1.0, max_new_tokens=6, seed=3, logprobs=True)
        first, second = one.generate(prompts[:2], **kw), one.generate(prompts[2:], first_request=2, **kw)
        assert r2.response_ids == first.response_ids + second.response_ids
        assert r2.logprobs == first.logprobs + second.logprobs
        assert second.response_ids != one.generate(prompts[2:], **kw).response_ids  # a stream of its own
        greedy = dict(n=1, temperature=0.0, max_new_tokens=5, seed=0)
        from common.tracking import Profile
        prof = Profile(True, tmp_path / "q", trace=False, engine=two)  # --profile-step: each child profiles its share
        assert two.generate(prompts, **greedy).response_ids == one.generate(prompts, **greedy).response_ids
        prof.stop(True)
        assert (tmp_path / "q_engine_0.txt").is_file() and (tmp_path / "q_engine_1.txt").is_file()
        # fewer prompts than engines: the idle engine is not asked, the rollout is the busy one's
        assert two.generate(PROMPTS[:1], **greedy).response_ids == one.generate(PROMPTS[:1], **greedy).response_ids
        assert two.generate([], **greedy).response_ids == []

        def zeros():
            here = HFEngine(str(tiny_model_dir), torch.device("cpu"), pad_token_id=0, eos_token_ids=[])
            for n, p in here.model.named_parameters():
                yield n, p.detach() * 0
        two.load_weights(zeros())  # many buckets (refit_bucket_mb 0), each taken by both children
        r = two.generate(prompts, n=2, temperature=1.0, max_new_tokens=4, seed=1, logprobs=True)
        vocab = HFEngine(str(tiny_model_dir), torch.device("cpu"), pad_token_id=0, eos_token_ids=[]).model.config.vocab_size
        uniform = -torch.log(torch.tensor(float(vocab))).item()
        assert all(abs(x - uniform) < 1e-4 for lp in r.logprobs for x in lp)  # both shares run the zero weights
        two.sleep(), two.wake(["weights"]), two.wake(["kv_cache"])
        assert two.resident_hint({}) is None and two.weights_discarded is False
        share = E.engine_share(args)  # what each child's engine is built with: its share of the limits
        assert (share.max_num_seqs, share.gpu_memory_utilization, share.num_engines) == (3, 0.15, 2)
    finally:
        one.close(), two.close()
    assert all(p.exitcode == 0 for p in two._procs)


@pytest.mark.slow  # several engine processes (tests/README.md, rule 4)
def test_an_error_in_one_engine_of_several_keeps_the_pipes_in_step(tiny_model_dir):
    two = E.EngineProcess("hf", str(tiny_model_dir), replace(resolved(), num_engines=2), 64, 0, 0, [], None)
    try:
        with pytest.raises(RuntimeError, match="(?s)failed in generate.*IndexError"):
            two.generate(PROMPTS[:1] + [[10**9]], n=1, temperature=1.0, max_new_tokens=2, seed=0)  # the 2nd share
        assert len(two.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=3, seed=0).response_ids) == 4
    finally:
        two.close()


@pytest.mark.slow  # several engine processes (tests/README.md, rule 4)
def test_several_engines_start_side_by_side_and_build_one_at_a_time(tiny_model_dir, tmp_path, monkeypatch):
    """Every child exists (its imports under way) before the first engine is built; engine k + 1 is told to build
    only once engine k is up (vLLM measures free GPU memory while it builds); when one build fails, the children
    still waiting for their turn are closed cleanly."""
    seen, objs, real = [], [], E.EngineProcess._answer_one

    def spy(self, k, what, expect="ok"):
        value = real(self, k, what, expect)
        objs[:] = [self]
        seen.append((k, expect, len(self._procs), sum(p.is_alive() for p in self._procs)))
        return value
    monkeypatch.setattr(E.EngineProcess, "_answer_one", spy)
    three = E.EngineProcess("hf", str(tiny_model_dir), replace(resolved(), num_engines=3), 64, 0, 0, [], None)
    try:
        assert [(k, e) for k, e, _, _ in seen] == [(0, "ready"), (0, "ok"), (1, "ready"), (1, "ok"), (2, "ready"),
                                                     (2, "ok")]
        assert all(n == 3 and alive == 3 for _, _, n, alive in seen)  # all three started before the first build
        assert len(sample(three).response_ids) == 4
    finally:
        three.close()
    seen.clear()
    with pytest.raises(RuntimeError, match="(?s)failed in start.*Traceback"):
        E.EngineProcess("hf", str(tmp_path / "no-such-model"), replace(resolved(), num_engines=2), 64, 0, 0, [], None)
    failed = objs[0]
    failed.close()
    assert [p.exitcode for p in failed._procs] == [0, 0]  # the second never built: closed while waiting


def test_several_engines_need_their_own_processes_and_a_batch_to_share():
    with pytest.raises(ValueError, match="num-engines 2 runs engines in processes of their own: add --vllm.own-process"):
        E.check_engine_args(replace(resolved(), num_engines=2))
    E.check_engine_args(replace(resolved(), num_engines=2, own_process=True))
    for bad in (0, 600):
        with pytest.raises(ValueError, match=f"num-engines {bad}: give 1 to 512"):
            E.EngineProcess("hf", "m", replace(resolved(), num_engines=bad), 64, 0, 0, [], None)


QWEN05, QWEN7 = 494_032_768, 7_615_616_512  # Qwen2.5-0.5B (W05's model) and Qwen2.5-7B: their parameters


def test_auto_engine_count_only_for_small_models_on_a_gpu_with_cores_to_spare():
    """--vllm.num-engines 0: 4 engines for W05's 0.5B model on an H200 with 16 cores (the measured case); fewer when
    the memory share or the cores run short; 1 for a 7B model, the HF engine, tensor parallelism or several ranks."""
    h200, h100, auto = 139 * 2**30, 80 * 2**30, VLLMArgs(num_engines=0)
    small, large = 2 * QWEN05, 2 * QWEN7  # bf16 bytes
    count = lambda *a, **k: E.auto_engine_count(*a, **k)[0]
    assert count("vllm", True, auto, small, h200, 16) == 4  # 0.35 x 139 GiB = 48.6 GiB, 6 x 8 x 0.92 GiB: capped
    assert count("vllm", True, auto, small, h100, 16) == 3  # 28 GiB holds 3 shares of 8 x the weights
    assert count("vllm", True, auto, small, h200, 5) == 2  # 2 cores per engine
    assert count("vllm", True, auto, small, h200, 1) == 1
    assert count("vllm", True, auto, small, h200, 128, ranks=8) == 1  # 8 ranks: measured with one rank only
    assert count("vllm", True, replace(auto, gpu_memory_utilization=0.1), small, h200, 16) == 1  # 13.9 GiB < 2 x 7.4
    assert count("vllm", True, replace(auto, max_num_seqs=2), small, h200, 16) == 2  # a sequence per engine at least
    assert count("vllm", True, auto, large, h200, 16) == 1  # 15.2 GB of weights: one engine
    n, why = E.auto_engine_count("vllm", True, replace(auto, tensor_parallel_size=2), small, h200, 16)
    assert (n, why) == (1, "--vllm.tensor-parallel-size 2: one engine across the ranks")
    assert E.auto_engine_count("hf", False, auto, small, 0, 16) == (1, "the HF engine")
    assert E.auto_engine_count("hf", True, auto, small, h200, 16) == (1, "the HF engine")  # --rollout hf on a GPU
    n, why = E.auto_engine_count("vllm", True, auto, small, h200, 16)
    assert why == "0.9 GiB of weights, 48.6 GiB for the engines (--vllm.gpu-memory-utilization 0.35), 16 CPU cores " \
                  "for this rank"


def test_resolve_num_engines_reads_the_gpu_the_cores_and_the_ranks(monkeypatch, capsys):
    """The count goes into the flags (the run's config records it) and --vllm.own-process follows it; with several
    ranks one engine each; a count given on the command line is left alone."""
    props = type("Props", (), {"total_memory": 139 * 2**30})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props if index == 0 else None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    gpu0 = 0  # the engines' GPU (child_gpu's index)
    args = VLLMArgs(num_engines=0)
    E.resolve_num_engines(args, "vllm", gpu0, QWEN05)
    assert (args.num_engines, args.own_process) == (4, True)
    assert "--vllm.num-engines auto: 4 engines per rank in processes of their own (0.9 GiB" in capsys.readouterr().out
    args = VLLMArgs(num_engines=0)  # several ranks: one engine each, in its process (not measured with more)
    E.resolve_num_engines(args, "vllm", gpu0, QWEN05, ranks=2, is_main=False)
    assert (args.num_engines, args.own_process) == (1, False) and capsys.readouterr().out == ""
    E.resolve_num_engines(VLLMArgs(num_engines=0), "vllm", gpu0, QWEN05, ranks=2)
    assert "1 engine per rank in the rank's process (2 ranks: several engines per rank were measured with one rank " \
           "only; --vllm.own-process --vllm.num-engines N asks for them)" in capsys.readouterr().out
    args = VLLMArgs(num_engines=0)
    E.resolve_num_engines(args, "vllm", gpu0, QWEN7)
    assert (args.num_engines, args.own_process) == (1, False)  # in the rank's process, as without the flag
    assert "1 engine per rank in the rank's process (14.2 GiB of weights" in capsys.readouterr().out
    args = VLLMArgs(num_engines=0, own_process=True)  # grpo_async.py's default process, kept
    E.resolve_num_engines(args, "hf", None, QWEN05)
    assert (args.num_engines, args.own_process) == (1, True)
    assert "1 engine per rank in a process of its own (the HF engine" in capsys.readouterr().out
    given = VLLMArgs(num_engines=3, own_process=True)
    E.resolve_num_engines(given, "vllm", gpu0, QWEN7)
    assert given.num_engines == 3


def test_a_negative_engine_count_is_refused():
    with pytest.raises(ValueError, match="num-engines -1: give a count of engines per rank, or 0 to pick it"):
        E.check_engine_args(replace(resolved(), num_engines=-1, own_process=True))
    E.check_engine_args(replace(resolved(), num_engines=0))  # auto needs no --vllm.own-process: it sets it


# ---- GPU + vLLM: the engine in its own process on the trainer's GPU ------------------------------------------------

@pytest.mark.gpu
def test_vllm_in_its_own_process_refits_over_cuda_ipc_and_over_cpu(tmp_path):
    """vLLM in the child on this process's GPU: the CUDA IPC probe succeeds, and a level-2 refit in several buckets
    (one engine.load_weights: vLLM checks every parameter came) takes, by either path. As tests/test_vllm_engine.py's
    refit test: greedy tokens within `tol` logits of transformers' argmax under the new weights (~15 below if not)."""
    from test_vllm_engine import HAS_GPU_VLLM, _assert_transformers_argmax, _greedy, _prompts, _tiny_qwen2
    if not HAS_GPU_VLLM:
        pytest.skip("needs a CUDA GPU and vLLM")
    first = _tiny_qwen2(tmp_path / "first", seed=0)
    second = _tiny_qwen2(tmp_path / "second", seed=1)
    args = replace(resolved(), gpu_memory_utilization=0.2, max_num_seqs=16, enforce_eager=True, refit_bucket_mb=16)
    there = E.EngineProcess("vllm", str(tmp_path / "first"), args, 128, 0, 0, [], E.child_gpu(-1, 0))
    try:
        assert there.refit_via == "cuda"
        prompts, outs = _prompts(), []
        for i, (via, model) in enumerate((("cuda", first), ("cuda", second), ("cpu", first))):
            there.refit_via = via
            if i:  # make_engine hands the engine over asleep
                there.sleep()
            there.wake(["weights"])
            assert there.weights_discarded  # level 2: nothing to generate with until the refit
            there.load_weights((n, p.detach().cuda()) for n, p in model.named_parameters())  # ~80 MB: 5+ buckets
            there.wake(["kv_cache"])
            assert not there.weights_discarded
            out = _greedy(there, prompts)
            _assert_transformers_argmax(out, model)
            outs.append(out.response_ids)
        assert outs[0] != outs[1] and outs[2] == outs[0]
    finally:
        there.close()


@pytest.mark.gpu
def test_two_vllm_engines_on_one_gpu_refit_over_cuda_ipc_and_sample_as_one(tmp_path):
    """--vllm.num-engines 2 on this process's GPU: both children take the CUDA IPC refit (greedy tokens are the new
    weights' argmax in both shares), and seeded sampling gives the rows one engine gives for the whole batch (request
    seeds follow the prompt's place in the batch; a row may still differ where batch numerics flip a token)."""
    from test_vllm_engine import HAS_GPU_VLLM, _assert_transformers_argmax, _greedy, _prompts, _tiny_qwen2
    if not HAS_GPU_VLLM:
        pytest.skip("needs a CUDA GPU and vLLM")
    first = _tiny_qwen2(tmp_path / "first", seed=0)
    second = _tiny_qwen2(tmp_path / "second", seed=1)
    args = replace(resolved(), gpu_memory_utilization=0.2, max_num_seqs=16, enforce_eager=True, refit_bucket_mb=16)
    prompts = _prompts(num=6)
    kw = dict(n=4, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, seed=11, logprobs=True)

    def ready(engine, model):  # make_engine hands an engine over asleep (level 2: no weights until a refit)
        engine.wake(["weights"])
        assert engine.weights_discarded
        engine.load_weights((n, p.detach().cuda()) for n, p in model.named_parameters())
        engine.wake(["kv_cache"])
        assert not engine.weights_discarded

    one = E.EngineProcess("vllm", str(tmp_path / "first"), args, 128, 0, 0, [], E.child_gpu(-1, 0))
    try:
        ready(one, first)
        alone = one.generate(prompts, **kw)
    finally:
        one.close()
    two = E.EngineProcess("vllm", str(tmp_path / "first"), replace(args, num_engines=2), 128, 0, 0, [],
                          E.child_gpu(-1, 0))
    try:
        assert two.refit_via == "cuda" and len(two._procs) == 2
        ready(two, first)
        shared = two.generate(prompts, **kw)
        assert shared.prompt_ids == alone.prompt_ids
        same = sum(a == b for a, b in zip(shared.response_ids, alone.response_ids))
        assert same >= 0.75 * len(alone.response_ids), f"{same} of {len(alone.response_ids)} rows as one engine's"
        two.sleep()
        ready(two, second)
        out = _greedy(two, prompts)
        assert len(out.response_ids) == 6
        _assert_transformers_argmax(out, second)  # rows 0-2 from one engine, 3-5 from the other
    finally:
        two.close()
