"""common/vllm_engine.py: pure helpers on CPU (CI); the engine itself on a GPU with vLLM (@pytest.mark.gpu)."""
import importlib.util
import json
import os
import subprocess
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import ROOT

from common.rollout import Rollout
from common.vllm_engine import (LLM_KWARGS_OWN, GiB, VLLMArgs, VLLMEngine, bucket_by_bytes, check_memory_budget,
                                extra_llm_kwargs, kv_cache_bytes, remap_tied, request_seeds, resident_hint,
                                to_rollout, tp_layout)

HAS_GPU_VLLM = torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


# ---- memory budget ------------------------------------------------------------------------------------------------

def test_memory_budget_fits_and_returns_what_training_keeps():
    left = check_memory_budget(140 * GiB, 130 * GiB, 0.35, training_bytes_estimate=10 * GiB)
    assert left == 140 * GiB - int(0.35 * 140 * GiB) - 10 * GiB


def test_memory_budget_more_than_free_names_the_knob():
    with pytest.raises(ValueError, match="--vllm.gpu-memory-utilization") as e:
        check_memory_budget(140 * GiB, 60 * GiB, 0.99, training_bytes_estimate=80 * GiB)
    assert "lower" in str(e.value)


def test_memory_budget_training_estimate_too_large():
    # free now, but the trainer will keep 100 GiB resident while vLLM is awake
    with pytest.raises(ValueError, match="--vllm.gpu-memory-utilization"):
        check_memory_budget(140 * GiB, 139 * GiB, 0.5, training_bytes_estimate=100 * GiB)


@pytest.mark.parametrize("util", [0.0, 1.0, 1.5, -0.1])
def test_memory_budget_rejects_bad_fractions(util):
    with pytest.raises(ValueError, match="in \\(0, 1\\)"):
        check_memory_budget(140 * GiB, 140 * GiB, util)



def test_resident_hint_only_when_both_fit_and_the_engine_sleeps():
    # W05 on one GPU of a 2 x H200 host (2026-11-30): engine ~6.3 GiB (weights, fitted KV, graphs), training
    # peak 31 GiB, swap 0.2 s
    hint = resident_hint(140 * GiB, int(6.3 * GiB), 31 * GiB, 0.21, sleep_level=2)
    assert "--vllm.sleep-level 0" in hint and "6.3 GiB" in hint and "31.0 GiB" in hint and "0.21 s" in hint
    assert resident_hint(140 * GiB, int(6.3 * GiB), 31 * GiB, 0.21, sleep_level=0) is None  # resident already
    assert resident_hint(140 * GiB, 40 * GiB, 90 * GiB, 2.0, sleep_level=1) is None  # 130 > 90 % of 140: no room
    assert resident_hint(140 * GiB, 40 * GiB, 85 * GiB, 2.0, sleep_level=1) is not None  # 125 <= 126


# ---- construction errors -------------------------------------------------------------------------------------------

def test_missing_vllm_says_rollout_hf(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    with pytest.raises(RuntimeError, match="--rollout hf") as e:
        VLLMEngine("unused", VLLMArgs(), max_model_len=128, seed=0)
    assert "vLLM is not installed" in str(e.value)


def test_no_cuda_says_rollout_hf(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="--rollout hf"):
        VLLMEngine("unused", VLLMArgs(), max_model_len=128, seed=0)


@pytest.mark.parametrize("level", [-1, 3])
def test_unknown_sleep_level_lists_the_three(level, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # checked before vLLM is even needed
    with pytest.raises(ValueError, match=r"--vllm.sleep-level must be 0 \(stay resident\), 1 .* or 2"):
        VLLMEngine("unused", VLLMArgs(sleep_level=level), max_model_len=128, seed=0)


# ---- refit bucketing and tied embeddings ------------------------------------------------------------------------

def test_bucket_by_bytes_respects_bound_and_order():
    sizes = [10, 30, 60, 5, 100, 200, 1, 1, 50]  # float32 elements -> 4 bytes each
    named = [(f"p{i}", torch.zeros(s)) for i, s in enumerate(sizes)]
    max_bytes = 400
    buckets = list(bucket_by_bytes(iter(named), max_bytes))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]  # order kept, nothing lost
    for b in buckets:
        nbytes = sum(t.numel() * 4 for _, t in b)
        assert nbytes <= max_bytes or len(b) == 1  # only a lone tensor may exceed the bound (200 * 4 = 800)
    assert any(len(b) == 1 and b[0][0] == "p5" for b in buckets)


def test_bucket_by_bytes_is_lazy():
    def gen():
        yield "a", torch.zeros(100)
        yield "b", torch.zeros(100)
        raise AssertionError("consumed past the first full bucket")
    first = next(iter(bucket_by_bytes(gen(), max_bytes=400)))
    assert [n for n, _ in first] == ["a"]


def test_bucket_by_bytes_empty():
    assert list(bucket_by_bytes([], 100)) == []


def test_remap_tied():
    e, h, w = torch.zeros(1), torch.ones(1), torch.zeros(2)
    both = [("model.embed_tokens.weight", e), ("model.norm.weight", w), ("lm_head.weight", h)]
    assert [n for n, _ in remap_tied(both, tied=True)] == ["model.embed_tokens.weight", "model.norm.weight"]
    assert [n for n, _ in remap_tied(both, tied=False)] == [n for n, _ in both]
    only_head = [("lm_head.weight", h), ("model.norm.weight", w)]
    out = list(remap_tied(only_head, tied=True))
    assert [n for n, _ in out] == ["model.norm.weight", "model.embed_tokens.weight"] and out[1][1] is h
    head_first = [("lm_head.weight", h), ("model.embed_tokens.weight", e)]
    assert [n for n, _ in remap_tied(head_first, tied=True)] == ["model.embed_tokens.weight"]


# ---- vLLM outputs -> Rollout -----------------------------------------------------------------------------------

def _completion(index, toks, reason, logp=-0.5):
    return SimpleNamespace(index=index, token_ids=toks, finish_reason=reason,
                           logprobs=[{t: SimpleNamespace(logprob=logp - j)} for j, t in enumerate(toks)])


def test_to_rollout_prompt_major_and_reasons():
    outs = [SimpleNamespace(prompt_token_ids=[1, 2], outputs=[_completion(1, [7], "length"),
                                                               _completion(0, [5, 6, 2], "stop")]),
            SimpleNamespace(prompt_token_ids=[3], outputs=[_completion(0, [8, 9], "stop"),
                                                           _completion(1, [4], "length")])]
    r = to_rollout(outs)
    assert isinstance(r, Rollout)
    assert r.prompt_ids == [[1, 2], [1, 2], [3], [3]]
    assert r.response_ids == [[5, 6, 2], [7], [8, 9], [4]]  # sorted by sample index within a prompt
    assert r.finish_reasons == ["stop", "length", "stop", "length"]
    assert r.logprobs == [[-0.5, -1.5, -2.5], [-0.5], [-0.5, -1.5], [-0.5]]


class _Flat(list):
    """Stand-in for vllm.logprobs.FlatLogprobs with logprobs=0: one entry per position, flat lists of ids / values."""

    def __init__(self, toks, values):
        super().__init__([None] * len(toks))
        self.token_ids, self.logprobs = list(toks), list(values)


def test_to_rollout_reads_flat_logprobs():
    toks = [5, 6, 2]
    c = SimpleNamespace(index=0, token_ids=toks, finish_reason="stop", logprobs=_Flat(toks, [-0.1, -0.2, -0.3]))
    assert to_rollout([SimpleNamespace(prompt_token_ids=[1], outputs=[c])]).logprobs == [[-0.1, -0.2, -0.3]]


def test_to_rollout_refuses_log_probs_of_other_tokens_than_the_sampled_ones():
    """grpo_async.py with generation on a CUDA stream of its own (one H200, 2026-12-02): FlatLogprobs whose token ids
    were not the sampled ones; the per-position lookup then raised a bare KeyError. Now: what is wrong, where, and what
    it means."""
    toks = [5, 6, 2]
    c = SimpleNamespace(index=0, token_ids=toks, finish_reason="stop", logprobs=_Flat([5, 9, 2], [-0.1, -0.2, -0.3]))
    c.logprobs[:] = [{5: SimpleNamespace(logprob=-0.1)}, {9: SimpleNamespace(logprob=-0.2)},
                     {2: SimpleNamespace(logprob=-0.3)}]
    with pytest.raises(RuntimeError, match="position 1 .of 1. the sampled token is 6, the log-probs are for .9.*"
                                           "cannot be trusted"):
        to_rollout([SimpleNamespace(prompt_token_ids=[1], outputs=[c])])
    c.logprobs[1] = {6: SimpleNamespace(logprob=-0.2)}  # the dict path itself, when the lists agree with the tokens
    assert to_rollout([SimpleNamespace(prompt_token_ids=[1], outputs=[c])]).logprobs == [[-0.1, -0.2, -0.3]]


def test_to_rollout_without_logprobs_and_bad_reason():
    c = SimpleNamespace(index=0, token_ids=[5], finish_reason="stop", logprobs=None)
    assert to_rollout([SimpleNamespace(prompt_token_ids=[1], outputs=[c])]).logprobs is None
    c.finish_reason = "abort"
    with pytest.raises(RuntimeError, match="abort"):
        to_rollout([SimpleNamespace(prompt_token_ids=[1], outputs=[c])])


# ---- sleep / wake / refit bookkeeping, through a stand-in for vllm.LLM (the real one: the GPU tests below) -----------

class _FakeLLM:
    """Records the calls VLLMEngine makes; generate echoes one token per request."""

    def __init__(self):
        self.calls = []
        self.model = SimpleNamespace(load_weights=lambda b: [n for n, _ in b],
                                     named_parameters=lambda: [("w", None)])

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def apply_model(self, fn):
        return [fn(self.model)]

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append(("generate", len(prompts)))
        one = dict(index=0, token_ids=[9], finish_reason="length", logprobs=None)
        return [SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], outputs=[SimpleNamespace(**one)])
                for p in prompts]


def _fake_engine(monkeypatch, level):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kw: kw))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    engine = VLLMEngine.__new__(VLLMEngine)  # everything __init__ sets that these paths read, without a GPU
    engine.args, engine.verbose, engine.llm = VLLMArgs(sleep_level=level), False, _FakeLLM()
    engine.device, engine.dtype, engine.tied, engine.timings = torch.device("cpu"), torch.float32, False, {}
    engine.max_model_len, engine.dp_rank, engine._tp_group, engine._flat = 64, 0, None, {}
    engine._asleep, engine.weights_discarded = set(), False
    return engine


def _gen(engine):
    return engine.generate([[1, 2]], n=1, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=1, seed=0)


def test_level_0_never_sleeps_and_a_refit_still_resets_the_prefix_cache(monkeypatch):
    engine = _fake_engine(monkeypatch, level=0)
    engine.sleep()
    engine.wake(["weights"])
    engine.load_weights([("w", torch.ones(2))])
    engine.wake(["kv_cache"])
    assert _gen(engine).response_ids == [[9]]
    engine.sleep()
    assert _gen(engine).response_ids == [[9]]  # straight after a level-0 sleep
    assert engine.llm.calls == [("reset_prefix_cache",), ("generate", 1), ("generate", 1)]


def test_level_2_sleeps_and_refuses_to_generate_until_woken_and_refitted(monkeypatch):
    engine = _fake_engine(monkeypatch, level=2)
    engine.sleep()
    with pytest.raises(RuntimeError, match="wake"):
        _gen(engine)
    engine.wake(["weights"])
    engine.wake(["kv_cache"])
    with pytest.raises(RuntimeError, match="load_weights"):  # the weights are garbage after a level-2 sleep
        _gen(engine)
    engine.load_weights([("w", torch.ones(2))])
    assert _gen(engine).response_ids == [[9]]
    engine.wake()  # awake already: nothing to map
    assert engine.llm.calls == [("sleep", 2), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"]),
                                ("reset_prefix_cache",), ("generate", 1)]


class _DrawingLLM(_FakeLLM):
    """generate draws each request's tokens where vLLM draws for requests without a seed of their own: one from the
    default generator (the V1 model runner's noise) and one from numpy's global generator (the V2 runner's
    per-request seed, vllm/v1/worker/gpu/sample/states.py); it records whether the request carried a seed."""

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append(("seeds", [p["seed"] for p in params]))
        one = lambda: dict(index=0, token_ids=[int(torch.randint(1000, (1,))), int(np.random.randint(1000))],
                           finish_reason="length", logprobs=None)
        return [SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], outputs=[SimpleNamespace(**one())])
                for p in prompts]


def test_no_seed_requests_draws_one_stream_per_call_from_the_step_seed(monkeypatch):
    # --vllm.no-seed-requests: no per-request seeds (the V1 model runner draws their noise one request at a time);
    # instead the device's and numpy's generators are seeded from the call's seed, replica and share, so the same
    # step draws the same tokens whatever drew before it, and the caller's own stream continues as if untouched.
    engine = _fake_engine(monkeypatch, level=0)
    engine.args.seed_requests, engine.llm = False, _DrawingLLM()
    gen = lambda seed, first=0: engine.generate([[1, 2], [3]], n=1, temperature=1.0, top_p=1.0, top_k=0,
                                                max_new_tokens=1, seed=seed, first_request=first).response_ids
    torch.manual_seed(0)
    a = gen(5)
    torch.rand(100)  # the trainer draws in between
    np.random.rand(7)
    assert gen(5) == a  # reproducible per step (a resumed run redraws step 5 the same)
    assert gen(6) != a and gen(5, first=2) != a  # another step, another share of the batch: another stream
    assert engine.llm.calls[0] == ("seeds", [None, None])  # no request carries a seed
    torch.manual_seed(1)
    np.random.seed(1)
    gen(5)
    after, np_after = torch.rand(3), np.random.rand(3)
    torch.manual_seed(1)
    np.random.seed(1)
    assert torch.equal(torch.rand(3), after) and (np.random.rand(3) == np_after).all()  # the caller's streams restored
    torch.manual_seed(3)
    np.random.seed(4)  # numpy's stream alone moved (the V2 runner's draws): the same step still draws the same
    assert gen(5) == a
    engine.args.seed_requests = True  # per-request seeds: the default generator is left alone
    torch.manual_seed(2)
    gen(5)
    assert engine.llm.calls[-1][0] == "seeds" and None not in engine.llm.calls[-1][1]
    after = torch.rand(3)
    torch.manual_seed(2)
    torch.randint(1000, (2,))  # what the two requests drew
    assert torch.equal(torch.rand(3), after)


# ---- --vllm.llm-kwargs -------------------------------------------------------------------------------------------

def test_llm_kwargs_parse_and_refuse_what_the_engine_sets():
    assert extra_llm_kwargs("") == {} and extra_llm_kwargs("  ") == {}
    nested = '{"attention_config": {"flash_attn_max_num_splits_for_cuda_graph": 1}, "max_num_batched_tokens": 8192}'
    assert extra_llm_kwargs(nested) == {"attention_config": {"flash_attn_max_num_splits_for_cuda_graph": 1},
                                        "max_num_batched_tokens": 8192}
    with pytest.raises(ValueError, match="is not JSON .*give a JSON object"):
        extra_llm_kwargs("{max_num_batched_tokens: 8192}")  # the quotes a shell ate
    with pytest.raises(ValueError, match="is a JSON list"):
        extra_llm_kwargs("[1, 2]")
    with pytest.raises(ValueError, match=r"sets \['gpu_memory_utilization', 'seed'\].*use --vllm.gpu-memory-utilization"):
        extra_llm_kwargs('{"seed": 3, "gpu_memory_utilization": 0.9}')
    with pytest.raises(ValueError, match="enable_sleep_mode.*docs/vllm.md"):
        extra_llm_kwargs('{"enable_sleep_mode": false}')
    from common.engine_process import check_engine_args  # every script checks it before an engine starts
    with pytest.raises(ValueError, match="not JSON"):
        check_engine_args(VLLMArgs(llm_kwargs="{"))


class _Built(Exception):
    """Raised by the stand-in vllm.LLM once it has seen its arguments."""


def test_llm_kwargs_reach_vllm_llm_beside_the_engine_own(monkeypatch, tmp_path):
    # VLLMEngine.__init__ on the CPU up to vllm.LLM(...), with the GPU and the process group stood in for: the extra
    # arguments arrive as given beside the engine's own (LLM_KWARGS_OWN), with the values the flags give
    seen = {}

    def llm(**kwargs):
        seen.update(kwargs)
        raise _Built

    import common.vllm_engine as V
    monkeypatch.setattr(V, "_import_vllm", lambda: SimpleNamespace(LLM=llm))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (130 * GiB, 140 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(V.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(V.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(V.dist, "get_world_size", lambda: 1)
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    args = VLLMArgs(llm_kwargs='{"max_num_batched_tokens": 8192, "attention_config": {"backend": "FLASH_ATTN"}}')
    with pytest.raises(_Built):
        VLLMEngine(str(tmp_path), args, max_model_len=64, seed=1)
    assert seen["max_num_batched_tokens"] == 8192 and seen["attention_config"] == {"backend": "FLASH_ATTN"}
    assert set(seen) - {"max_num_batched_tokens", "attention_config"} == set(LLM_KWARGS_OWN)
    assert (seen["seed"], seen["max_model_len"], seen["max_num_seqs"]) == (1, 64, 512)  # seed + replica 0, the flags
    with pytest.raises(ValueError, match="use --vllm.max-num-seqs"):  # refused before vLLM is called
        VLLMEngine(str(tmp_path), VLLMArgs(llm_kwargs='{"max_num_seqs": 8}'), max_model_len=64, seed=1)


# ---- KV cache sizing ---------------------------------------------------------------------------------------------

def test_kv_cache_bytes_equals_what_transformers_caches():
    """The formula against a real cache: a tiny GQA Qwen2's past_key_values after T tokens, in bf16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    T = 7
    with torch.no_grad():
        cache = model(torch.zeros(1, T, dtype=torch.long), use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert kv_cache_bytes(cfg.to_dict(), 1, T, 2, block_size=1, margin=1.0) == held


def test_kv_cache_bytes_w05_whole_blocks_and_margin():
    qwen05 = {"num_hidden_layers": 24, "num_attention_heads": 14, "hidden_size": 896, "num_key_value_heads": 2,
              "sliding_window": 32768, "use_sliding_window": False, "layer_types": ["full_attention"] * 24}
    per_token = 24 * 2 * 2 * 64 * 2  # layers x (K, V) x kv heads x head_dim x bf16
    assert kv_cache_bytes(qwen05, 512, 768, 2, margin=1.0) == 512 * 768 * per_token
    assert kv_cache_bytes(qwen05, 512, 770, 2, margin=1.0) == 512 * 784 * per_token  # 49 blocks of 16
    assert kv_cache_bytes(qwen05, 512, 768, 2) == int(512 * 768 * per_token * 1.1)
    assert kv_cache_bytes({"text_config": qwen05}, 1, 16, 2, margin=1.0) == 16 * per_token  # multimodal nesting


@pytest.mark.parametrize("extra", [{"sliding_window": 4096},  # Mistral: windowed unless use_sliding_window false
                                   {"layer_types": ["sliding_attention", "full_attention"]},  # Gemma-style
                                   {"kv_lora_rank": 512},  # DeepSeek MLA
                                   {"layers_block_type": ["mamba", "attention"]}])
def test_kv_cache_bytes_leaves_other_attention_to_vllm(extra):
    base = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    assert kv_cache_bytes(base, 1, 16, 2) is not None
    assert kv_cache_bytes(base | extra, 1, 16, 2) is None
    assert kv_cache_bytes({"num_hidden_layers": 2}, 1, 16, 2) is None  # not a decoder config we can read


# ---- seeds, layout, eos --------------------------------------------------------------------------------------------

def test_request_seeds_distinct_across_prompts_samples_replicas_steps():
    n = 8
    all_child_seeds = set()
    for step in range(3):
        for dp in range(4):
            for s in request_seeds(step, dp, 64, n):
                all_child_seeds.update(range(s, s + n))  # vLLM seeds the n children s..s+n-1
                assert 0 <= s < 2**62
    assert len(all_child_seeds) == 3 * 4 * 64 * n


def test_tp_layout_consecutive_groups():
    assert tp_layout(0, 4, 1) == (0, 4, 0, [0])
    assert tp_layout(3, 4, 2) == (1, 2, 1, [2, 3])
    assert tp_layout(5, 8, 4) == (1, 2, 1, [4, 5, 6, 7])
    with pytest.raises(ValueError, match="--vllm.tensor-parallel-size"):
        tp_layout(0, 6, 4)


def test_cpu_block_splits_cores_keeping_siblings_together():
    from common.dist import cpu_block
    cpus = list(range(32))
    assert cpu_block(0, 2, cpus) == list(range(16)) and cpu_block(1, 2, cpus) == list(range(16, 32))
    smt = {c: c % 16 for c in cpus}  # siblings (c, c + 16), as Linux numbers hyper-threads
    blocks = [cpu_block(r, 2, cpus, smt) for r in range(2)]
    assert blocks[0] == list(range(8)) + list(range(16, 24)) and blocks[1] == list(range(8, 16)) + list(range(24, 32))
    three = [cpu_block(r, 3, list(range(8))) for r in range(3)]  # uneven: sizes differ by at most one, no overlap
    assert sorted(c for b in three for c in b) == list(range(8)) and {len(b) for b in three} == {2, 3}
    assert cpu_block(1, 4, [5, 9]) == [5, 9]  # fewer cores than ranks: keep them all
    with pytest.raises(ValueError, match="local rank"):
        cpu_block(2, 2, cpus)


def test_numa_cpu_block_stays_near_each_gpu():
    from common.dist import numa_cpu_block, parse_cpulist
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11} and parse_cpulist("") == set()
    allowed = list(range(32))
    sockets = [set(range(16))] * 4 + [set(range(16, 32))] * 4  # 8 GPUs, 4 per socket
    blocks = [numa_cpu_block(r, sockets, allowed) for r in range(8)]
    assert blocks[0] == [0, 1, 2, 3] and blocks[5] == [20, 21, 22, 23]  # rank 5: 2nd of the 4 ranks on socket 1
    assert sorted(c for b in blocks for c in b) == allowed  # a partition: no CPU shared, none left out
    # unknown locality (a VM): the whole allowed set is split as by cpu_block
    assert [numa_cpu_block(r, [None, None], allowed) for r in range(2)] == [list(range(16)), list(range(16, 32))]
    # a GPU's node outside this process's allowed CPUs: fall back to the allowed ones rather than bind to nothing
    assert numa_cpu_block(0, [{40, 41}], [0, 1]) == [0, 1]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_bind_cpus_binds_every_thread_of_the_process():
    """In a child process (binding is process-wide): a thread started before the binding is bound too."""
    code = """
import os, threading, time
from common.dist import bind_cpus, cpu_block
allowed = sorted(os.sched_getaffinity(0))
stop = threading.Event()
t = threading.Thread(target=stop.wait); t.start()
block = bind_cpus(0, 2)
assert block and set(block) <= set(allowed), (block, allowed)
if len(allowed) >= 2:
    assert len(block) < len(allowed)
for tid in os.listdir("/proc/self/task"):
    assert sorted(os.sched_getaffinity(int(tid))) == block, tid
stop.set(); t.join()
print("BOUND", block)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert "BOUND" in out.stdout


def test_eos_token_ids(tmp_path, tokenizer):
    from common.models import eos_token_ids
    endoftext, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": endoftext}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, endoftext]}))
    assert eos_token_ids(tokenizer, str(tmp_path)) == sorted({tokenizer.eos_token_id, endoftext, im_end})


# ---- GPU + vLLM ------------------------------------------------------------------------------------------------

VOCAB, PROMPT_LEN, NEW = 151936, 12, 16


def _tiny_qwen2(path, seed):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=151643, bos_token_id=151643)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # final norm x10: logits spread (std ~3, median top-2 gap ~4), so greedy choices are
        model.model.norm.weight.fill_(10.0)  # mostly clear; a larger embedding std would make it copy its input
    model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def engine_and_model(tmp_path_factory):
    from common.dist import init_distributed
    import torch.distributed as dist
    if not dist.is_initialized():
        init_distributed("cuda")
    path = tmp_path_factory.mktemp("tiny_qwen2")
    _tiny_qwen2(path, seed=0)
    # vLLM's own KV sizing (no fit): a pool large against the rest, as at W05 scale, for the sleep test's share;
    # the fitted pool is what every W05 run uses (bench/w05.py; vLLM logs its size)
    engine = VLLMEngine(str(path), VLLMArgs(gpu_memory_utilization=0.3, max_num_seqs=64, kv_cache_fit=False,
                                            verbose=True), max_model_len=128, seed=0)
    perturbed = _tiny_qwen2(tmp_path_factory.mktemp("perturbed"), seed=1)  # fresh random weights
    yield engine, perturbed


def _prompts(num=4, length=PROMPT_LEN):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (num, length), generator=g).tolist()


def _greedy(engine, prompts):
    return engine.generate(prompts, n=1, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=NEW, seed=0,
                           ignore_eos=True)


def _assert_transformers_argmax(rollout, model, tol=0.5) -> int:
    """Every greedy vLLM token within `tol` logits of the argmax of `model` (bf16 weights computed in fp32,
    teacher-forced on vLLM's tokens); returns how many are exactly the argmax. Tokens of other weights (a refit
    that did not take, or prompt KV cached under the old weights) fall ~15 logits below."""
    ref = model.float().cuda().eval()
    exact = 0
    try:
        for p, r in zip(rollout.prompt_ids, rollout.response_ids):
            assert len(r) == NEW
            ids = torch.tensor([p + r], device="cuda")
            with torch.no_grad():
                logits = ref(ids).logits[0, len(p) - 1:-1].float()  # (NEW, V) predicting each response token
            chosen = logits.gather(-1, torch.tensor(r, device="cuda")[:, None])[:, 0]
            gap = logits.max(-1).values - chosen  # 0 where vLLM picked transformers' argmax
            assert gap.max().item() <= tol, f"vLLM token {gap.argmax().item()} is {gap.max().item():.2f} below argmax"
            exact += int((gap == 0).sum())
    finally:
        model.to(torch.bfloat16).cpu()
    return exact


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU_VLLM, reason="needs a CUDA GPU and vLLM")
def test_refit_then_greedy_matches_transformers(engine_and_model):
    """bf16 vLLM after a refit vs the same bf16 weights in transformers (computed in fp32, teacher-forced on
    vLLM's tokens). bf16 kernels differ, so exact token equality is only required where the choice is not a
    near-tie: every vLLM token must be within `tol` logits of the transformers argmax. A refit that did not
    take would pick tokens ~15 logits below the argmax of the new weights."""
    engine, perturbed = engine_and_model
    prompts = _prompts()
    before = _greedy(engine, prompts)
    engine.sleep()
    engine.wake(["weights"])
    secs = engine.load_weights((n, p.detach().cuda()) for n, p in perturbed.named_parameters())
    engine.wake(["kv_cache"])
    assert secs > 0
    after = _greedy(engine, prompts)
    assert after.response_ids != before.response_ids, "the refit changed nothing"
    exact = _assert_transformers_argmax(after, perturbed)
    print(f"greedy tokens equal to transformers' argmax: {exact}/{len(prompts) * NEW}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU_VLLM, reason="needs a CUDA GPU and vLLM")
def test_engine_pool_is_in_torchs_counter_also_asleep(engine_and_model):
    """The premise of perf/trainer_peak_gib (common/perf.py): vLLM's weights and KV cache are allocated through torch,
    so torch's allocated counter holds them, and a sleep (memory unmapped behind torch's back) does not lower it.
    If this fails, trainer_peak_gib subtracts memory torch never counted: drop count_engine_pool."""
    from common.tracking import engine_pool_gib
    engine, perturbed = engine_and_model
    assert engine_pool_gib() * GiB > 0.5 * engine.held_bytes  # most of what the engine holds is in the counter
    awake = torch.cuda.memory_allocated()
    engine.sleep()
    try:
        assert torch.cuda.memory_allocated() >= awake - 0.1 * engine_pool_gib() * GiB
    finally:  # back as the refit test left it (a level-2 sleep discards the weights)
        engine.wake(["weights"])
        engine.load_weights((n, p.detach().cuda()) for n, p in perturbed.named_parameters())
        engine.wake(["kv_cache"])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU_VLLM, reason="needs a CUDA GPU and vLLM")
def test_sleep_level_0_stays_resident_and_a_refit_still_takes(engine_and_model, tmp_path):
    """--vllm.sleep-level 0: sleep and wake keep everything on the GPU, and a refit between them must still reach
    the tokens, including prompts whose KV the prefix cache holds from the old weights (40-token prompts: two
    full blocks of 16 cached)."""
    import dataclasses
    engine, perturbed = engine_and_model
    original = _tiny_qwen2(tmp_path, seed=0)  # the fixture's first weights
    saved_args = engine.args
    engine.args = dataclasses.replace(saved_args, sleep_level=0)
    prompts = _prompts(4, length=40)
    try:
        engine.load_weights((n, p.detach().cuda()) for n, p in original.named_parameters())
        first = _greedy(engine, prompts)  # fills the prefix cache with the original weights' prompt KV
        _assert_transformers_argmax(first, original)
        free_before = torch.cuda.mem_get_info()[0]
        engine.sleep()
        assert abs(torch.cuda.mem_get_info()[0] - free_before) < 0.1 * engine.held_bytes, "level 0 released memory"
        engine.wake(["weights"])
        engine.load_weights((n, p.detach().cuda()) for n, p in perturbed.named_parameters())
        engine.wake(["kv_cache"])
        second = _greedy(engine, prompts)
        assert second.response_ids != first.response_ids, "the refit changed nothing"
        _assert_transformers_argmax(second, perturbed)
        engine.sleep()
        third = _greedy(engine, prompts)  # level 0: sleep() left the engine ready to generate
        assert third.response_ids == second.response_ids
    finally:
        engine.args = saved_args


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU_VLLM, reason="needs a CUDA GPU and vLLM")
def test_logprobs_shape_and_sign(engine_and_model):
    engine, _ = engine_and_model
    r = engine.generate(_prompts(3), n=4, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=NEW, seed=1)
    assert len(r.response_ids) == 12 and r.prompt_ids[:4] == [r.prompt_ids[0]] * 4  # prompt-major
    assert r.logprobs is not None
    for toks, lps, reason in zip(r.response_ids, r.logprobs, r.finish_reasons):
        assert len(lps) == len(toks) > 0 and all(lp <= 1e-6 for lp in lps)
        assert reason in ("stop", "length")
    # host accounting: CPU seconds of the generating thread, which cannot exceed the wall time it ran in
    assert 0 < engine.timings["generate_cpu"] <= engine.timings["generate"] + 0.01
    assert engine.timings["generate_preempted"] >= 0
    again = engine.generate(_prompts(3), n=4, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=NEW, seed=1)
    if engine.args.seed_requests:
        assert again.response_ids == r.response_ids  # per-request seeds make sampling reproducible
    engine.args.seed_requests = False  # --vllm.no-seed-requests: one stream per call, seeded from the call's seed
    try:
        one = engine.generate(_prompts(3), n=4, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=NEW, seed=2)
        torch.rand(1000, device="cuda")  # the trainer draws in between
        two = engine.generate(_prompts(3), n=4, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=NEW, seed=2)
        assert one.response_ids == two.response_ids
    finally:
        engine.args.seed_requests = True


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU_VLLM, reason="needs a CUDA GPU and vLLM")
def test_wake_returns_torchs_cached_blocks(engine_and_model):
    """Training between sleep and wake leaves its freed activations in torch's cache, where vLLM's pool cannot use them;
    wake() hands them back first (W7B-2 ran out of memory waking the KV cache without it, 2 x H200, 2026-11-30)."""
    engine, perturbed = engine_and_model
    engine.sleep()
    x = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
    del x  # freed into torch's cache: still reserved
    reserved = torch.cuda.memory_reserved()
    engine.wake(["weights"])
    assert torch.cuda.memory_reserved() <= reserved - int(1.5 * GiB)
    engine.load_weights((n, p.detach().cuda()) for n, p in perturbed.named_parameters())
    engine.wake(["kv_cache"])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU_VLLM, reason="needs a CUDA GPU and vLLM")
def test_sleep_frees_what_the_engine_held(engine_and_model):
    engine, _ = engine_and_model
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    free_asleep = torch.cuda.mem_get_info()[0]
    try:
        assert free_asleep - free_awake >= 0.8 * engine.held_bytes, (
            f"sleep freed {(free_asleep - free_awake) / GiB:.2f} GiB of {engine.held_bytes / GiB:.2f} GiB held")
        with pytest.raises(RuntimeError, match="wake"):
            engine.generate(_prompts(1), n=1, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=4, seed=0)
    finally:
        engine.wake()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU_VLLM, reason="needs a CUDA GPU and vLLM")
def test_too_high_memory_utilization_names_the_knob(tmp_path):
    from common.dist import init_distributed
    import torch.distributed as dist
    if not dist.is_initialized():
        init_distributed("cuda")
    _tiny_qwen2(tmp_path, seed=0)
    held = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")  # the trainer's weights, say
    try:
        with pytest.raises(ValueError, match="--vllm.gpu-memory-utilization"):
            VLLMEngine(str(tmp_path), VLLMArgs(gpu_memory_utilization=0.99), max_model_len=128, seed=0)
    finally:
        del held


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU_VLLM, reason="needs a CUDA GPU and vLLM")
def test_hf_export_loads_in_vllm_with_the_trainers_greedy_tokens(engine_and_model, tmp_path):
    """Issue 8: a trained FSDP2 policy exported with --export-hf loads in vLLM, whose greedy tokens are the
    trainer's (within the bf16 near-tie tolerance of the refit test)."""
    from common.checkpoint import export_hf
    from common.fsdp import FSDPArgs, shard
    from common.models import TokenLogProbs, load_causal_lm
    src = tmp_path / "src"
    _tiny_qwen2(src, seed=3)
    policy, _ = shard(lm := load_causal_lm(str(src), "sdpa"), FSDPArgs(), torch.device("cuda"),
                   root=TokenLogProbs(lm, "torch"))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)  # one update, so the export differs from the source
    ids = torch.tensor([_prompts(1)[0]], device="cuda")
    logp, _ = policy(ids, torch.arange(ids.shape[1], device="cuda")[None], ids.roll(-1, 1))
    (-logp.sum()).backward()
    opt.step()
    out = export_hf(policy, None, None, tmp_path / "export", prefix="lm.", dtype=torch.bfloat16)
    engine, _ = engine_and_model
    engine.sleep()  # make room for a second engine
    # A fresh process, as a user would load it: a second vLLM engine inside this one (next to the fixture's)
    # hit an illegal memory access in its first forward on the H200 (vLLM keeps per-process state).
    script = (
        "import json, sys\n"
        "from vllm import LLM, SamplingParams\n"
        "llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype='bfloat16', gpu_memory_utilization=0.2,\n"
        "          max_model_len=128, enforce_eager=True)\n"
        "prompts = json.loads(sys.argv[2])\n"
        "outs = llm.generate([{'prompt_token_ids': p} for p in prompts], SamplingParams(temperature=0.0, "
        "max_tokens=int(sys.argv[3]), ignore_eos=True, detokenize=False), use_tqdm=False)\n"
        "print('GREEDY ' + json.dumps([list(o.outputs[0].token_ids) for o in outs]))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-c", script, str(out), json.dumps(_prompts()), str(NEW)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    greedy = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("GREEDY "))[len("GREEDY "):])
    outs = [SimpleNamespace(prompt_token_ids=p, outputs=[SimpleNamespace(token_ids=r)])
            for p, r in zip(_prompts(), greedy)]
    from common.fsdp import iter_full_params
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    saved = load_file(str(out / "model.safetensors"))
    for name, t in iter_full_params(policy, prefix="lm."):  # the export holds exactly the trainer's weights
        assert torch.equal(saved[name].cuda(), t.to(torch.bfloat16)), name
    # The refit path of a model kept gathered (--fsdp.keep-gathered): every unit gathered at once, bf16 copies
    # that outlive the iterator; the engine refit from it decodes like the export.
    for name, t in list(iter_full_params(policy, prefix="lm.", gather_all=True)):
        assert t.dtype == torch.bfloat16 and torch.equal(saved[name].cuda(), t), name
    engine.wake(["weights"])
    engine.load_weights(iter_full_params(policy, prefix="lm.", gather_all=True))
    engine.wake(["kv_cache"])
    refit = engine.generate(_prompts(), n=1, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=NEW, seed=0,
                            ignore_eos=True)
    outs += [SimpleNamespace(prompt_token_ids=p, outputs=[SimpleNamespace(token_ids=r)])
             for p, r in zip(refit.prompt_ids, refit.response_ids)]
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).cuda().eval()
    for o in outs:
        p, r = list(o.prompt_token_ids), list(o.outputs[0].token_ids)
        with torch.no_grad():
            logits = ref(torch.tensor([p + r], device="cuda")).logits[0, len(p) - 1:-1]
        gap = logits.max(-1).values - logits.gather(-1, torch.tensor(r, device="cuda")[:, None])[:, 0]
        assert gap.max().item() <= 0.5, f"exported model's greedy token is {gap.max().item():.2f} below argmax"
