"""Algorithm code shared by scripts is copied on purpose and marked `# Same as grpo.py:name`; the copies must stay
identical to the original (../shared/STYLE.md, 'Sharing and duplication')."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARK = re.compile(r"#\s*Same as (\w+\.py):(\w+)")


def functions(path: Path) -> dict[str, str]:
    """name -> source of each top-level function (decorators included)."""
    src = path.read_text()
    tree = ast.parse(src)
    lines = src.splitlines()
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
            out[node.name] = "\n".join(lines[start:node.end_lineno])
    return out


def marked_copies():
    found = []
    for script in sorted(ROOT.glob("*.py")):
        lines = script.read_text().splitlines()
        for i, line in enumerate(lines):
            m = MARK.search(line)
            if m:
                # the marked function is the next def after the comment (decorators may sit between)
                for follow in lines[i + 1:i + 4]:
                    d = re.match(r"\s*(?:def|class) (\w+)", follow)
                    if d:
                        found.append((script.name, d.group(1), m.group(1), m.group(2)))
                        break
    return found


COPIES = marked_copies()


def test_there_are_marked_copies():
    assert COPIES, "no '# Same as' markers found: ppo.py should mark what it copies from grpo.py"


@pytest.mark.parametrize("script,name,orig_script,orig_name", COPIES, ids=[f"{c[0]}:{c[1]}" for c in COPIES])
def test_marked_copy_is_identical(script, name, orig_script, orig_name):
    copy = functions(ROOT / script)[name]
    orig = functions(ROOT / orig_script)[orig_name]
    assert copy.replace(f"def {name}(", f"def {orig_name}(") == orig, (
        f"{script}:{name} drifted from {orig_script}:{orig_name}; copy the original again or drop the marker")
