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


# ------------------------------------------------------------ the call's package (issue 25)

PIPELINE = ROOT / "pipeline"
# The core: what the call, its stages and its transports all stand on. It knows no stage.
CORE = ("events", "ports", "turn", "timeline", "sentences", "report", "mqtt", "playout", "io", "config",
        "receptionist")
CALL_MAX_LINES, METHOD_MAX_LINES = 350, 40


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path) -> set[str]:
    """The pipeline modules a file imports when it runs (at any depth: a deferred import in
    a function counts), leaving out what only a type checker reads (`if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pipeline.x import y` names module pipeline.x.y when y is a module.
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {name for name in found if name.split(".")[0] == "pipeline"}


def _pipeline_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in sorted(PIPELINE.rglob("*.py"))}
    return {name: {m for m in _runtime_imports(path) if m in files and m != name} for name, path in files.items()}


def _under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, each once (from its first module in sorted order)."""
    found, seen = [], set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == path[0]:
                key = frozenset(path)
                if key not in seen:
                    seen.add(key)
                    found.append(path + [nxt])
            elif nxt not in path and nxt > path[0]:
                walk(nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, [start])
    return found


def _breaks(graph: dict[str, set[str]], importers: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return [f"{m} imports {sorted(i for i in deps if _under(i, *forbidden))}" for m, deps in sorted(graph.items())
            if _under(m, *importers) and any(_under(i, *forbidden) for i in deps)]


def test_stages_never_import_the_call_nor_a_transport():
    graph = _pipeline_graph()
    assert _breaks(graph, ("pipeline.stages",), ("pipeline.call", "pipeline.conversation",
                                                  "pipeline.transports")) == []


def test_transports_never_import_a_stage():
    assert _breaks(_pipeline_graph(), ("pipeline.transports",), ("pipeline.stages",)) == []


def test_the_core_never_imports_a_stage_nor_the_call():
    core = tuple(f"pipeline.{m}" for m in CORE)
    assert _breaks(_pipeline_graph(), core, ("pipeline.stages", "pipeline.call", "pipeline.agent",
                                             "pipeline.conversation", "pipeline.transports")) == []


def test_no_import_cycle_inside_pipeline():
    assert _cycles(_pipeline_graph()) == []


def test_the_layering_checks_see_a_break():
    """The rules above can fail: a stage importing the call, a cycle, are caught."""
    graph = {"pipeline.stages.speak": {"pipeline.call"}, "pipeline.call": {"pipeline.stages.speak"},
             "pipeline.turn": {"pipeline.stages.speak"}}
    assert _breaks(graph, ("pipeline.stages",), ("pipeline.call",)) == ["pipeline.stages.speak imports ['pipeline.call']"]
    assert _breaks(graph, ("pipeline.turn",), ("pipeline.stages",))
    assert _cycles(graph) == [["pipeline.call", "pipeline.stages.speak", "pipeline.call"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_call_fits_on_a_screen():
    """pipeline/call.py stays small, and so does each of its functions: the call connects
    stages; what grows belongs in a stage, the report or the events."""
    path = PIPELINE / "call.py"
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= CALL_MAX_LINES, f"pipeline/call.py has {len(lines)} lines (at most {CALL_MAX_LINES})"
    long = [f"{n.name}: {n.end_lineno - n.lineno + 1} lines" for n in ast.walk(ast.parse("\n".join(lines)))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > METHOD_MAX_LINES]
    assert long == []
