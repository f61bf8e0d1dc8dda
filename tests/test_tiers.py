"""The two tiers (tests/README.md): the README's first test command (the default tier) collects no test marked slow and
one end-to-end run of every training script; its full-suite command, the one .ci/run runs, collects every test. Both
collections run in this process (pytest.main --collect-only over modules already imported: a few seconds)."""
import re
import shlex

import pytest

from conftest import FULL_SUITE, ROOT

SCRIPTS = ["grpo", "ppo", "dpo", "sft", "rm", "grpo_async"]


def readme_test_commands() -> list[str]:
    """The `python -m pytest tests` lines of the README's bash blocks, in order."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    lines = [line.split("#")[0].strip() for b in blocks for line in b.splitlines()]  # without the comments
    return [line for line in lines if line.startswith("python -m pytest tests")]


class Collected:
    """A plugin that keeps the items a collection selected and counts the deselected ones."""

    def __init__(self):
        self.items, self.deselected = [], 0

    def pytest_deselected(self, items):
        self.deselected += len(items)

    def pytest_collection_finish(self, session):
        self.items = list(session.items)


def collect(command: str) -> Collected:
    """What `command` (a `python -m pytest tests ...` line) selects, collected in this process from the repository."""
    argv = shlex.split(command)
    assert argv[:4] == ["python", "-m", "pytest", "tests"], command
    plugin = Collected()
    code = pytest.main([str(ROOT / "tests"), *argv[4:], "--collect-only", "-p", "no:cacheprovider",
                        "--rootdir", str(ROOT)], plugins=[plugin])
    assert code == pytest.ExitCode.OK, (command, code)
    return plugin


@pytest.fixture(scope="module")
def commands() -> list[str]:
    cmds = readme_test_commands()
    assert len(cmds) >= 2, cmds
    return cmds


def test_the_readme_shows_the_default_tier_first_and_ci_runs_the_full_suite(commands):
    default, full = commands[0], FULL_SUITE
    assert default == "python -m pytest tests -q"
    assert full in commands[1:]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert full in ci and default not in ci  # CI runs the full suite, not the default tier


def test_default_tier_holds_no_slow_test_and_a_run_of_each_script(commands):
    tier = collect(commands[0])
    slow = [item.nodeid for item in tier.items if item.get_closest_marker("slow")]
    assert not slow, f"the default tier collected tests marked slow: {slow}"
    assert tier.deselected > 0 and len(tier.items) > 300
    smoke = {item.callspec.params["name"] for item in tier.items
             if item.nodeid.startswith("tests/test_smoke.py::test_script_runs_and_writes_its_metrics")}
    assert smoke == set(SCRIPTS)


def test_full_suite_selects_every_test():
    full = collect(FULL_SUITE)
    assert full.deselected == 0
    slow = [item for item in full.items if item.get_closest_marker("slow")]
    assert len(slow) > 20 and len(full.items) > len(slow) + 300
