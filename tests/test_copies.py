"""Algorithm code shared by scripts is copied on purpose and marked `# Same as grpo.py:name`; the copies must stay
identical to the original (docs/architecture.md, "Line budgets and marked copies")."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARK = re.compile(r"#\s*Same as (\w+\.py):(\w+)")


def top_level(path: Path) -> list[tuple[str, int, int, str]]:
    """(name, first line, def line, source) of each top-level function or class; lines 0-based, decorators included
    in the source."""
    src = path.read_text()
    lines = src.splitlines()
    out = []
    for node in ast.parse(src).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            out.append((node.name, start, node.lineno - 1, "\n".join(lines[start:node.end_lineno])))
    return out


def functions(path: Path) -> dict[str, str]:
    """name -> source of each top-level function (decorators included)."""
    return {name: src for name, _, _, src in top_level(path)}


def marked_copies(root: Path = ROOT):
    """(script, name, original script, original name) for every marker: one on the comment lines just above a
    top-level def (decorators may sit between), or at the end of its `def` (or decorator) line; and the markers that
    belong to no top-level function (nothing would check those), as "script line N"."""
    found, orphans = [], []
    for script in sorted(root.glob("*.py")):
        lines = script.read_text().splitlines()
        defs = top_level(script)
        for i, line in enumerate(lines):
            m = MARK.search(line)
            if not m:
                continue
            owner = [name for name, start, def_line, _ in defs if start <= i <= def_line]  # on the def/decorator line
            owner = owner or [name for name, start, _, _ in defs if i < start <= i + 3
                              and all(not x.strip() or x.lstrip().startswith("#") for x in lines[i + 1:start])]
            if owner:
                found.append((script.name, owner[0], m.group(1), m.group(2)))
            else:
                orphans.append(f"{script.name} line {i + 1}")
    return found, orphans


def strip_marker(src: str) -> str:
    """the source without the marker comment (it sits on the def line for `def f(...):  # Same as grpo.py:f`)"""
    return re.sub(r"[ \t]*" + MARK.pattern + r"[^\n]*", "", src)


COPIES, ORPHANS = marked_copies()


def test_there_are_marked_copies():
    assert COPIES, "no '# Same as' markers found: ppo.py should mark what it copies from grpo.py"


def test_every_marker_names_a_top_level_function():
    assert not ORPHANS, (f"markers not on or just above a top-level def, so no test checks them: {ORPHANS}; "
                         "put the marker on the def line or the comment line above it")


def test_marker_finder_on_def_lines_and_above(tmp_path):
    (tmp_path / "a.py").write_text("def f(x):\n    return x + 1\n\n\ndef g():\n    pass\n")
    (tmp_path / "b.py").write_text("# Same as a.py:f\n@staticmethod\ndef f(x):\n    return x + 1\n\n\n"
                                   "def h(x):  # Same as a.py:f\n    return x + 2\n\n\n"
                                   "def outer():\n    def inner():  # Same as a.py:g\n        pass\n")
    found, orphans = marked_copies(tmp_path)
    assert found == [("b.py", "f", "a.py", "f"), ("b.py", "h", "a.py", "f")]
    assert orphans == ["b.py line 12"]  # a nested def: not a top-level function
    h = strip_marker(functions(tmp_path / "b.py")["h"])
    assert h.splitlines()[0] == "def h(x):"
    assert h.replace("def h(", "def f(") != functions(tmp_path / "a.py")["f"]  # the drift the test below catches


@pytest.mark.parametrize("script,name,orig_script,orig_name", COPIES, ids=[f"{c[0]}:{c[1]}" for c in COPIES])
def test_marked_copy_is_identical(script, name, orig_script, orig_name):
    copy = strip_marker(functions(ROOT / script)[name])
    orig = functions(ROOT / orig_script)[orig_name]
    assert copy.replace(f"def {name}(", f"def {orig_name}(") == orig, (
        f"{script}:{name} drifted from {orig_script}:{orig_name}; copy the original again or drop the marker")
