"""The layout of docs/architecture.md ("What may import what"), checked on the repository's own files: which
folder may import which, no import cycle inside common/, vLLM imported by common/vllm_engine.py alone, dev/ on the
standard library only."""
import ast
import sys
from pathlib import Path

from conftest import ROOT

PROJECT = {"common", "kernels", "tools", "bench", "dev", "tests", "grpo", "ppo", "dpo"}
SCRIPTS = {"grpo", "ppo", "dpo"}
ALLOWED = {  # folder (or "scripts") -> project packages its files may import
    "scripts": {"common", "kernels"},
    "tools": {"common", "kernels", "tools"},
    "bench": {"common", "kernels", "bench"},
    "common": {"common", "kernels"},
    "kernels": {"kernels"},
    "dev": set(),
}


def imports(path: Path) -> list[str]:
    """Every module name a file imports, at module level or inside functions (dotted, absolute)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]  # `from common import dist`
    return names


def group(rel: Path) -> str | None:
    if len(rel.parts) == 1:
        return "scripts" if rel.stem in SCRIPTS else None
    return rel.parts[0] if rel.parts[0] in ALLOWED else None


def violations(root: Path) -> list[str]:
    out, graph = [], {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        g = group(rel)
        if g is None:
            continue
        names = imports(path)
        for name in names:
            top = name.split(".")[0]
            if top in PROJECT and top not in ALLOWED[g]:
                out.append(f"{rel}: imports {name} ({g} may import {sorted(ALLOWED[g]) or 'no project module'})")
            if top == "vllm" and rel != Path("common/vllm_engine.py"):
                out.append(f"{rel}: imports {name} (vLLM is imported by common/vllm_engine.py alone)")
            if g == "dev" and top not in sys.stdlib_module_names and top not in PROJECT:
                out.append(f"{rel}: imports {name} (dev/ uses the standard library only)")
        if g == "common":
            graph[rel.stem] = {n.split(".")[1] for n in names if n.startswith("common.") and n.count(".") >= 1}
    for mod in graph:  # a cycle: a module reachable from itself
        seen, todo = set(), list(graph[mod])
        while todo:
            m = todo.pop()
            if m == mod:
                out.append(f"common/{mod}.py: import cycle inside common/")
                break
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
    return out


def test_repository_follows_the_layout():
    assert violations(ROOT) == []


def test_the_check_finds_what_breaks_the_layout(tmp_path):
    files = {
        "grpo.py": "import common.dist\nfrom ppo import loss\n",  # a script importing another script
        "ppo.py": "",
        "common/__init__.py": "",
        "common/dist.py": "def f():\n    from common import fsdp\n",  # a cycle through a function-level import
        "common/fsdp.py": "from common.dist import f\nfrom tools import export\n",
        "common/engine.py": "import vllm\n",
        "kernels/logprob.py": "from common import dist\n",
        "tools/export.py": "import grpo\n",
        "dev/queue.py": "import torch\n",
        "tests/test_x.py": "import grpo, vllm\n",  # tests may import anything
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = violations(tmp_path)
    expected = ["grpo.py: imports ppo", "common/fsdp.py: imports tools", "common/engine.py: imports vllm",
                "kernels/logprob.py: imports common", "tools/export.py: imports grpo", "dev/queue.py: imports torch",
                "common/dist.py: import cycle", "common/fsdp.py: import cycle"]
    for e in expected:
        assert any(v.startswith(e) for v in found), (e, found)
    assert not any(v.startswith("tests/") for v in found)
