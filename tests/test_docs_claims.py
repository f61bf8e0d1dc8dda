"""Every raw result the README and docs/ cite exists in the repository (issue 17, item 14: a claim points to a raw
file or says "not measured"), and no number in them is left pointing at a file that was pruned or never written."""
import re

from conftest import ROOT

CITED = re.compile(r"docs/results/[A-Za-z0-9_.=/-]+")  # "=": tools.sweep names cells key=value
IN_TABLE = re.compile(r"(?<![\w/.])(session\d+/[A-Za-z0-9_./-]+)")  # the tables' "raw file (docs/results/)" column


def cited_paths() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for m in CITED.finditer(text):
            out.setdefault(m.group(0).rstrip(".,:;)`"), []).append(doc.name)
        for m in IN_TABLE.finditer(text):
            out.setdefault("docs/results/" + m.group(1).rstrip(".,:;)`"), []).append(doc.name)
    return out


def test_every_cited_result_file_exists():
    cited = cited_paths()
    assert len(cited) >= 20  # the docs cite their raw results (the check is not vacuous)
    missing = {p: docs for p, docs in cited.items() if not (ROOT / p).exists()}
    assert not missing, f"cited but not in the repository: {missing}"


def test_the_check_catches_a_missing_file(tmp_path, monkeypatch):
    import test_docs_claims as T
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("see docs/results/nothing_here/metrics.jsonl.\n")
    (tmp_path / "docs" / "performance.md").write_text("| W05 | 9 s | cmd | abc | session9/w05/summary.json |\n")
    monkeypatch.setattr(T, "ROOT", tmp_path)
    assert T.cited_paths() == {"docs/results/nothing_here/metrics.jsonl": ["README.md"],
                               "docs/results/session9/w05/summary.json": ["performance.md"]}
