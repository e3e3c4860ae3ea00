"""Benchmarks sit on top: bench/ may import pipeline/, llm/ and voice/ (and demo/ may import
bench/), but nothing of the product below it imports a benchmark. Imports are parsed, not run."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imported(tree: ast.AST):
    """Every module an absolute import names (relative ones stay inside their package)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def _imports_bench(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return any(name.split(".")[0] == "bench" for name in _imported(tree))


def test_pipeline_llm_and_voice_never_import_bench():
    files = [p for folder in ("pipeline", "llm", "voice") for p in sorted((ROOT / folder).rglob("*.py"))]
    files += [ROOT / "threadrelay.py", ROOT / "modelstore.py"]
    assert len(files) > 20
    assert [str(p.relative_to(ROOT)) for p in files if _imports_bench(p)] == []


def test_the_check_sees_an_import_of_bench(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\ndef f():\n    from bench.load.serve import ServeProcess\n")
    assert _imports_bench(bad)
    (tmp_path / "ok.py").write_text("from pipeline.benchmarks import x\nimport benchmark\n")
    assert not _imports_bench(tmp_path / "ok.py")
