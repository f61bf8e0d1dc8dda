"""common/tracking.py: per-phase seconds and peak memory (timed, step_peak_gib), with torch.cuda's counters faked so
the bookkeeping runs on CPU."""
import pytest
import torch

from common.tracking import step_peak_gib, timed

GiB = 2**30


class FakeCounter:
    """torch.cuda.max_memory_allocated / reset_peak_memory_stats: the peak since the last reset."""

    def __init__(self):
        self.now, self.peak = 0, 0

    def alloc(self, n):
        self.now += n
        self.peak = max(self.peak, self.now)

    def free(self, n):
        self.now -= n

    def reset(self):
        self.peak = self.now


@pytest.fixture
def counter(monkeypatch):
    c = FakeCounter()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: c.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: c.reset())
    return c


def test_peak_memory_per_phase_and_per_step(counter):
    step_peak_gib()  # start from a clean step
    perf = {}
    counter.alloc(1 * GiB)  # resident before the step
    with timed(perf, "generate"):
        counter.alloc(4 * GiB)
        counter.free(4 * GiB)
    counter.alloc(6 * GiB)  # between phases: counted in the step, in no phase
    counter.free(6 * GiB)
    with timed(perf, "update"):
        counter.alloc(2 * GiB)
        counter.free(2 * GiB)
    with timed(perf, "update"):  # a phase timed twice in a step keeps its larger peak and sums its seconds
        counter.alloc(1 * GiB)
        counter.free(1 * GiB)
    assert perf["generate_peak_gib"] == 5 and perf["update_peak_gib"] == 3
    assert perf["update_s"] >= 0 and perf["generate_s"] >= 0
    assert step_peak_gib() == 7  # the 6 GiB between the phases on top of the resident 1
    assert set(perf) == {"generate_s", "generate_peak_gib", "update_s", "update_peak_gib"}  # all of it is logged
    with timed({}, "generate"):  # the next step starts from what is resident
        pass
    assert step_peak_gib() == 1


def test_no_gpu_no_memory_keys(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    perf = {}
    with timed(perf, "generate"):
        pass
    assert set(perf) == {"generate_s"}


def test_a_profile_arms_only_rank_0_s_engine_and_only_when_on(monkeypatch, tmp_path):
    """Profile(engine=...): the engine's own process profiles its next generate into <path>_engine (tests/
    test_engine_process.py runs it); on rank 0 only, as only rank 0 writes the tables (the ranks' engines would
    write the same file), and not at all when the Profile is off or the engine has no process of its own."""
    from common import dist
    from common.tracking import Profile

    class Child:
        def __init__(self):
            self.asked = []

        def profile_next(self, path):
            self.asked.append(path)

    engine = Child()
    Profile(False, tmp_path / "p", engine=engine)
    Profile(True, tmp_path / "p", trace=False, engine=object()).stop(True)  # in-process engine: nothing to ask
    monkeypatch.setattr(dist, "rank", lambda: 1)  # rank 1 of a group
    Profile(True, tmp_path / "p", trace=False, engine=engine).stop(False)
    assert engine.asked == []
    monkeypatch.setattr(dist, "rank", lambda: 0)
    Profile(True, tmp_path / "p", trace=False, engine=engine).stop(True)
    assert engine.asked == [tmp_path / "p_engine"]

