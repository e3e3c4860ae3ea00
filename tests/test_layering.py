"""The layering the design card promises, checked on the source (imports are parsed, not run):

- llm/ and voice/ import nothing of pipeline/ or demo/, nor each other;
- pipeline/ imports nothing of demo/;
- threadrelay (the one thread-to-asyncio relay both llm/ and voice/ use) imports nothing of the project;
- no module outside pipeline/transports/telephony names a Twilio event class or message;
- importing a module has no side effects on logging levels.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("llm", "voice", "pipeline", "demo", "configs", "threadrelay")
TELEPHONY = ROOT / "pipeline" / "transports" / "telephony"


def _modules(folder: str) -> list[Path]:
    base = ROOT / folder
    return [base] if base.suffix == ".py" else sorted(base.rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Top-level project packages a file imports (absolute imports; relative ones stay inside)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(n.split(".")[0] for n in names if n.split(".")[0] in PROJECT)
    return found


def _violations(folder: str, forbidden: set[str]) -> list[str]:
    return [f"{p.relative_to(ROOT)} imports {sorted(_imports(p) & forbidden)}"
            for p in _modules(folder) if _imports(p) & forbidden]


def test_llm_and_voice_import_nothing_above_them_nor_each_other():
    assert _violations("llm", {"voice", "pipeline", "demo"}) == []
    assert _violations("voice", {"llm", "pipeline", "demo"}) == []


def test_pipeline_imports_nothing_of_demo():
    assert _violations("pipeline", {"demo"}) == []


def test_threadrelay_imports_nothing_of_the_project():
    assert _imports(ROOT / "threadrelay.py") == set()


def test_the_checker_sees_a_violation(tmp_path):
    """The checks above can fail: a file that imports upward is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom pipeline.call import Call\nimport demo.cli\n")
    assert _imports(bad) == {"pipeline", "demo"}


# Twilio's event classes and the JSON event names it sends and receives.
_TWILIO_CLASSES = {"Connected", "Start", "Media", "Dtmf", "Mark", "Stop", "OutboundMedia", "OutboundMark", "Clear"}
_TWILIO_WIRE = re.compile(r"""["']event["']\s*:\s*["'](connected|start|media|dtmf|mark|stop|clear)["']""")


def _names_twilio(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text, str(path))
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and "telephony.protocol" in node.module:
            hits += [a.name for a in node.names if a.name in _TWILIO_CLASSES]
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in _TWILIO_CLASSES:
            hits.append(repr(node.value))  # picking events by class name, as a string
    hits += _TWILIO_WIRE.findall(text)
    return hits


def test_only_the_telephony_package_names_twilio_events():
    product = [p for folder in ("llm", "voice", "pipeline", "demo") for p in _modules(folder)]
    outside = {str(p.relative_to(ROOT)): _names_twilio(p) for p in product if TELEPHONY not in p.parents}
    assert {k: v for k, v in outside.items() if v} == {}
    # ...and the check does see them where they are.
    assert _names_twilio(TELEPHONY / "adapter.py")


def test_importing_modules_leaves_logging_alone():
    """No import-time side effects on logging (a module once pinned a logger's level)."""
    code = (
        "import logging, importlib, pkgutil\n"
        "before = dict(logging.Logger.manager.loggerDict)\n"
        "levels = lambda: {n: l.level for n, l in logging.Logger.manager.loggerDict.items()"
        " if isinstance(l, logging.Logger) and (n.startswith(('llm', 'voice', 'pipeline', 'demo')))}\n"
        "import pipeline, demo\n"
        "for pkg in (pipeline, demo):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "set_levels = {n: v for n, v in levels().items() if v != logging.NOTSET}\n"
        "assert not set_levels, set_levels\n"
        "assert logging.getLogger().level == logging.WARNING, logging.getLogger().level\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_the_web_transport_imports_no_stage():
    """pipeline/transports/web (the HTTP server, the page's call) reaches the call only through
    the call itself and its ports: no stage is imported there, at any depth of the file."""
    web = ROOT / "pipeline" / "transports" / "web"
    hits = []
    for path in sorted(web.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            hits += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("pipeline.stages")]
    assert hits == []
    assert (web / "browser.py").is_file()  # the check looks where the code is
