"""--sp-size (common/sequence_parallel.py, DeepSpeed-Ulysses): the geometry refusals, the row split (padding, the
whole row's boundaries, a fused loss's per-token constants cut to a rank's slice), the micro-batch as each rank of an
SP group sees it, and, through the scripts' own update on 2 and 4 gloo ranks (tests/sp_driver.py), log-probs, values,
losses, statistics and every parameter's gradient equal to --sp-size 1 within float32 round-off, for packed rows whose
sequences straddle a rank's slice boundary, with GQA, a sliding window, shared prompts and the fused-loss path. End to
end: a grpo.py checkpoint written at --sp-size 1 resumes at --sp-size 2."""
import importlib
import json
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import torchrun

import grpo
from common.args import _sections, cli
from common.models import TokenLoss
from common.packing import pack, pack_shared
from common.rl_setup import check_geometry
from common.sequence_parallel import SequenceParallel, check, data_parallel, rank_view


def config(heads=4, kv=2):
    text = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv)
    return SimpleNamespace(get_text_config=lambda: text)


@pytest.mark.parametrize("size, world, local, cfg, attn, match", [
    (0, 2, 2, None, "varlen", r"--sp-size 0: must be >= 1"),
    (2, 3, 3, None, "varlen", r"--sp-size 2 must divide the number of ranks \(3\).*change --sp-size"),
    (2, 4, 1, None, "varlen", r"--sp-size 2 must divide the ranks per node \(1\).*within a node"),
    (2, 2, 2, None, "sdpa", r"--sp-size 2 needs --attn-impl varlen.*not 'sdpa'"),
    (4, 4, 4, config(6, 6), "varlen", r"--sp-size 4 must divide the model's attention heads \(6\)"),
    (4, 4, 4, config(8, 2), "varlen", r"--sp-size 4 must divide the model's key-value heads \(2\)"),
])
def test_geometry_that_does_not_divide_is_refused(size, world, local, cfg, attn, match):
    with pytest.raises(ValueError, match=match):
        check(size, world, local, cfg, attn)


def test_geometry_that_divides_is_accepted():
    check(1, 3, 3, config(5, 5), "sdpa")  # --sp-size 1: nothing to check
    check(2, 8, 4, config(4, 2), "varlen")


def test_scripts_refuse_sp_with_a_replicated_reference_or_an_indivisible_world():
    args = grpo.Args(prompts_per_step=4, sp_size=2, kl_coef=0.1, reference="replicated")
    with pytest.raises(ValueError, match="--reference replicated .* --sp-size 2"):
        check_geometry(args, 2)
    with pytest.raises(ValueError, match=r"--sp-size 3 must divide the number of ranks \(2\)"):
        check_geometry(grpo.Args(prompts_per_step=4, sp_size=3), 2)
    check_geometry(grpo.Args(prompts_per_step=4, sp_size=2, kl_coef=0.1), 2)


@pytest.mark.parametrize("script", ["grpo", "grpo_async", "ppo", "sft"])
def test_flag_in_every_script(script, monkeypatch):
    Args = importlib.import_module(script).Args
    monkeypatch.setattr(sys, "argv", [script, "--sp-size", "2"])
    assert cli(Args).sp_size == 2 and Args().sp_size == 1
    assert "DeepSpeed-Ulysses" in _sections(Args)[1]["sp_size"]  # its --help line


def rows_of_split(sp_size, mb, loss=None):
    """Each rank's split() of a micro-batch (no collective runs in split)."""
    from common.attention import attn_kwargs
    return [SequenceParallel(sp_size, r).split(mb.input_ids, mb.position_ids, attn_kwargs(mb), mb.targets, loss)
            for r in range(sp_size)]


def test_split_pads_to_a_multiple_and_keeps_the_whole_rows_boundaries():
    prompts, responses = [[1, 2, 3], [4, 5], [6, 7, 8, 9]], [[10, 11], [12, 13, 14], [15, 16]]
    mb = pack(prompts, responses, [0, 1, 2])
    T = mb.num_tokens
    assert T == 16  # 3 ranks: padded to 18
    weight = torch.arange(len(mb.pos), dtype=torch.float32)  # one per scored token, in packed order
    parts = rows_of_split(3, mb, TokenLoss(lambda lp, ent, w: lp * w, 1.0, weight))
    L = -(-T // 3)
    ids = torch.cat([p[0] for p in parts], 1)
    assert ids.shape == (1, 3 * L) and torch.equal(ids[:, :T], mb.input_ids)
    pos = torch.cat([p[1] for p in parts], 1)
    assert torch.equal(pos[:, :T], mb.position_ids) and pos[0, T:].tolist() == list(range(3 * L - T))
    tgt = torch.cat([p[3] for p in parts], 1)
    assert torch.equal(tgt[:, :T], mb.targets) and (tgt[0, T:] == -100).all()  # padding enters no loss
    for _, _, kw, _, _ in parts:  # every rank: the whole padded row's boundaries, the padding a sequence of its own
        assert kw["cu_seq_lens_q"].tolist() == mb.cu_seqlens.tolist() + [3 * L]
        assert kw["max_length_q"] == mb.max_seqlen and kw["sequence_parallel"].size == 3
    # the fused loss's per-token constants: each rank gets those of the scored tokens in its slice, in order
    cut = [p[4].token_args[1] for p in parts]
    assert torch.equal(torch.cat(cut), weight)
    assert [len(c) for c in cut] == [int((p[3] != -100).sum()) for p in parts]


def test_split_of_shared_prompts_extends_the_keys_with_the_padding():
    prompts, responses = [[1, 2, 3, 4]] * 2, [[5, 6], [7, 8, 9]]
    mb = pack_shared(prompts, responses, [0, 1])  # 3 + 3 + 4 = 10 tokens
    (_, _, kw, _, _), _ = rows_of_split(4, mb)[:2]
    assert mb.num_tokens == 10
    assert kw["kv_index"].tolist() == mb.kv_index.tolist() + [10, 11]
    assert kw["cu_seq_lens_k"].tolist() == mb.cu_seqlens_k.tolist() + [int(mb.cu_seqlens_k[-1]) + 2]
    assert kw["cu_seq_lens_q"].tolist() == mb.cu_seqlens.tolist() + [12]


def test_rank_view_the_first_rank_keeps_the_rows_the_others_the_tokens():
    prompts, responses = [[1, 2], [3, 4, 5]], [[6, 7, 8], [9]]
    mb = pack(prompts, responses, [0, 1])
    owner, other = (rank_view([SimpleNamespace(sp=SequenceParallel(2, r))], mb) for r in (0, 1))
    assert owner is mb
    assert torch.equal(other.input_ids, mb.input_ids) and torch.equal(other.targets, mb.targets)
    assert other.rows == [] and len(other.index) == len(other.pos) == 0
    values = torch.randn(2, 4)  # (B, T) per-token constants of the caller's batch
    assert torch.equal(other.take(values), mb.take(values))  # the fused loss's constants on every rank
    out = torch.randn(1, mb.num_tokens, requires_grad=True)
    empty = other.unpack(out, 4)
    assert empty.shape == (0, 4)
    empty.sum().backward()  # still a path to the outputs: the gather's backward runs on every rank
    assert out.grad is not None and not out.grad.any()
    assert rank_view([SimpleNamespace()], mb) is mb  # no --sp-size


def test_data_parallel_share_of_an_sp_group():
    sp = SimpleNamespace(sp=SequenceParallel(2, 1))
    assert data_parallel([sp], 8, 5) == (4, 2)
    assert data_parallel([SimpleNamespace()], 8, 5) == (8, 5)
    with pytest.raises(ValueError, match="share one --sp-size"):
        data_parallel([sp, SimpleNamespace()], 8, 5)
    with pytest.raises(ValueError, match="cannot hold SP groups"):
        data_parallel([sp], 1, 0)  # a pass meant for one rank alone (a replicated model)


def run_driver(tmp_path, nproc, cases):
    out = tmp_path / f"sp{nproc}.pt"
    torchrun("tests/sp_driver.py", str(out), "2", *cases, nproc=nproc, env={"HF_HUB_OFFLINE": "1"})
    return torch.load(out)


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def check_equal(results, sp):
    for name, res in results.items():
        one, many = res[1], res[sp]
        assert one["all_to_alls"] == 0 and many["all_to_alls"] > 0, name  # the SP path ran, and only there
        L = [-(-t // sp) for t, _ in many["layouts"]]
        straddle = [any(a < l * j < b for j in range(1, sp) for a, b in zip(cu[:-1], cu[1:]))
                    for l, (t, cu) in zip(L, many["layouts"])]
        assert any(straddle), f"{name}: no sequence crosses a slice boundary"
        assert any(t % sp for t, _ in many["layouts"]), f"{name}: no row needed padding"
        assert one["grads"].keys() == many["grads"].keys()
        for k, g in many["grads"].items():
            assert one["grads"][k].abs().sum() > 0, (name, k)
            assert rel(g, one["grads"][k]) < 2e-5, f"{name}: {k} differs by {rel(g, one['grads'][k]):.1e}"
        for k, v in one["stats"].items():
            assert float(many["stats"][k]) == pytest.approx(float(v), rel=2e-5, abs=1e-6), (name, k)
        assert one["stats"][next(iter(one["stats"]))] != 0
        if "loss" in one:
            assert float(many["loss"]) == pytest.approx(float(one["loss"]), rel=2e-5, abs=1e-7), name
        if "logp" in one:
            assert one["logp"].abs().sum() > 0
            torch.testing.assert_close(many["logp"], one["logp"], atol=1e-5, rtol=1e-5)
        if "values" in one:
            for a, b in zip(many["values"], one["values"]):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        if "eval" in one:
            assert many["eval"] == pytest.approx(one["eval"], rel=1e-5)


@pytest.mark.slow
def test_sp2_equals_sp1_two_ranks(tmp_path):
    check_equal(run_driver(tmp_path, 2, ["grpo-gqa", "grpo-window", "grpo-fused", "ppo", "sft"]), 2)


@pytest.mark.slow
def test_sp2_times_dp2_equals_dp4_four_ranks(tmp_path):
    check_equal(run_driver(tmp_path, 4, ["grpo-gqa", "sft"]), 2)


@pytest.mark.slow
def test_checkpoint_written_at_sp1_resumes_at_sp2(tiny_model_dir, tmp_path):
    base = ["--model", str(tiny_model_dir), "--reward-fn", "tests.toy_reward:letters", "--prompts-per-step", "2",
            "--group-size", "4", "--max-new-tokens", "6", "--lr", "1e-2", "--top-k", "10", "--eval-every", "0",
            "--num-steps", "2", "--deterministic", "--out-dir", str(tmp_path)]
    torchrun("grpo.py", *base, "--save-every", "1", "--exp-name", "sp1", nproc=2)
    p = torchrun("grpo.py", *base, "--sp-size", "2", "--exp-name", "sp2", "--resume",
                 str(tmp_path / "sp1" / "checkpoints" / "step_000001"), nproc=2)
    assert "step    1 |" in p.stdout and "step    0 |" not in p.stdout, p.stdout[-3000:]
    assert "2 x 1" in p.stdout  # the geometry table: SP 2 x data-parallel 1
    rows = {n: [json.loads(l) for l in open(tmp_path / n / "metrics.jsonl") if '"train/loss"' in l]
            for n in ("sp1", "sp2")}
    one, two = rows["sp1"][1], rows["sp2"][0]
    assert one["step"] == two["step"] == 1
    assert one["reward/mean"] == two["reward/mean"]  # the same weights sampled the same completions
    for k in ("train/loss", "train/grad_norm", "train/entropy"):
        assert two[k] == pytest.approx(one[k], rel=1e-4, abs=1e-7), k
