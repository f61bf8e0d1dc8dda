"""Line budgets (docs/architecture.md, "Line budgets and marked copies"): each training script stays under its budget
and its loop (the body of `for step in ...` in main) under 130 lines, so a reader can hold the script, and one step, in
their head. Past a budget, shared machinery moves to common/ or the algorithm becomes a variant script."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUDGETS = {"grpo.py": 550, "ppo.py": 650, "dpo.py": 450, "sft.py": 400, "rm.py": 400, "grpo_async.py": 550}
LOOP_BUDGET = 130
SCRIPTS = [s for s in BUDGETS if (ROOT / s).exists()]


def step_loops(source: str) -> list[ast.For]:
    """Every `for step in ...` statement of the file."""
    return [n for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.For) and isinstance(n.target, ast.Name) and n.target.id == "step"]


def loop_body_lines(loop: ast.For) -> int:
    """Lines of the loop's body, from its first statement to its last (comments and blank lines between count)."""
    return loop.body[-1].end_lineno - loop.body[0].lineno + 1


def test_the_three_scripts_are_measured():
    assert {"grpo.py", "ppo.py", "dpo.py", "grpo_async.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_within_line_budget(script):
    n = len((ROOT / script).read_text().splitlines())
    assert n <= BUDGETS[script], f"{script} has {n} lines, over its budget of {BUDGETS[script]}: move shared " \
                                 "machinery to common/ (docs/architecture.md, 'Line budgets and marked copies')"


@pytest.mark.parametrize("script", SCRIPTS)
def test_loop_within_budget(script):
    loops = step_loops((ROOT / script).read_text())
    assert len(loops) == 1, f"{script}: expected one `for step in ...` loop, found {len(loops)}"
    n = loop_body_lines(loops[0])
    assert n <= LOOP_BUDGET, f"{script}: the loop's body is {n} lines, over {LOOP_BUDGET}"


def test_loop_measure_counts_the_body():
    src = "def main():\n    x = 0\n    for step in range(3):\n        a = 1\n\n        # c\n        b = 2\n    y = 1\n"
    (loop,) = step_loops(src)
    assert loop_body_lines(loop) == 4
    assert step_loops("for i in range(3):\n    pass\n") == []
