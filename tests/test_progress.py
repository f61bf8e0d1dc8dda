"""common/progress.py: what rank 0 says between step lines, on a bar and without one; the HF engine's token
progress; the GGUF conversion message."""
import io

import pytest
import torch
from tqdm import tqdm

import common.progress as P
from common.tracking import Progress


@pytest.fixture(autouse=True)
def _fresh_state():
    P._active.clear()
    P._first_step.clear()
    yield
    P._active.clear()
    P._first_step.clear()


def _bar_progress() -> Progress:
    progress = Progress(False, 10)  # then a real, enabled bar writing to a buffer (not a terminal: forced on)
    progress.enabled, progress.bar = True, tqdm(total=10, file=io.StringIO(), disable=False)
    return progress


def test_without_bar_prints_the_first_steps_phases_only(capsys):
    progress = Progress(True, 10)  # stderr is not a terminal under pytest: no bar, lines only
    assert progress.bar is None or progress.bar.disable
    P.show_phase(progress, 3, "evaluating on 16 held-out prompts (greedy)")
    P.show_phase(progress, 3, "generating 2 prompts x 8 samples")
    P.show_phase(progress, 4, "generating 2 prompts x 8 samples")
    out = capsys.readouterr().out.splitlines()
    assert out == ["step 3: evaluating on 16 held-out prompts (greedy) ...", "step 3: generating 2 prompts x 8 samples ..."]
    assert P.token_streamer(48) is None  # no bar: no per-token output


def test_other_ranks_say_nothing(capsys):
    progress = Progress(False, 10)
    P.show_phase(progress, 0, "generating 2 prompts x 8 samples")
    P.note(False, "reference log-probs of 10 pairs")
    assert capsys.readouterr().out == "" and P.token_streamer(48) is None


def test_bar_shows_phase_and_moves_with_tokens(capsys):
    progress = _bar_progress()
    P.show_phase(progress, 2, "generating 2 prompts x 8 samples")
    assert progress.bar.desc == "step 2: generating 2 prompts x 8 samples"
    streamer = P.token_streamer(48)
    seen = []
    for _ in range(1 + 9):  # the prompts, then 9 decoding steps
        streamer.put(torch.zeros(2, 1))
        seen.append(progress.bar.desc)
    assert "step 2: generating 2 prompts x 8 samples: token 1/48" in seen
    assert seen[-1] == "step 2: generating 2 prompts x 8 samples: token 8/48"
    streamer.end()
    assert progress.bar.desc == "step 2: generating 2 prompts x 8 samples"
    assert capsys.readouterr().out == ""  # on the bar, not as lines


def test_hf_engine_reports_tokens_on_the_bar(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.rollout import HFEngine
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    engine = HFEngine(str(tmp_path), torch.device("cpu"), pad_token_id=0, eos_token_ids=[])
    progress = _bar_progress()
    descs = []
    progress.bar.set_description_str = lambda s, refresh=True: descs.append(s)
    P.show_phase(progress, 0, "generating 1 prompts x 2 samples")
    out = engine.generate([[1, 2, 3]], n=2, max_new_tokens=9, ignore_eos=True, logprobs=False)
    assert [len(r) for r in out.response_ids] == [9, 9]
    assert "step 0: generating 1 prompts x 2 samples: token 8/9" in descs
    assert descs[-1] == "step 0: generating 1 prompts x 2 samples"  # end() restores the phase


def test_gguf_conversion_says_what_it_does(tmp_path, monkeypatch, capsys):
    """The conversion prints before it starts (it is silent for up to a minute otherwise) and when it is done."""
    import common.models as M

    class Fake:
        config = type("C", (), {})()

        def save_pretrained(self, path):
            path.mkdir(parents=True)
            (path / "config.json").write_text("{}")

    monkeypatch.setattr(M, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(M.AutoTokenizer, "from_pretrained", lambda *a, **k: type("T", (), {
        "save_pretrained": lambda self, p: None})())
    monkeypatch.setattr(M.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Fake())
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    out = M.resolve_model(str(gguf))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"converting m.gguf to an HF folder {out} (once per GGUF file")
    assert lines[1].startswith("converted in ")
    assert M.resolve_model(str(gguf)) == out and capsys.readouterr().out == ""  # cached: silent
