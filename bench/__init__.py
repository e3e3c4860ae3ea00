"""The benchmarks behind `specvoice bench KIND`: each prints its figures and writes JSON.

Everything about benchmarks is found here: the code (one module per KIND, each with HELP,
DESCRIPTION, add_arguments(parser) and run(args); the registry is demo/commands/bench.py),
the data only benchmarks read (`data/`), the saved runs the README quotes (`results/`),
`gpu.sh` (the GPU checks) and `openai_answers.py` (`python -m bench.openai_answers`).
Benchmarks are never tests: speed claims come from here.

Layering: bench/ imports pipeline/, llm/, voice/ (and the demo's simulated caller);
demo/ may import bench/; pipeline/, llm/ and voice/ never import bench/.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the source tree (tests/realengine.py, ../shared)
DATA = Path(__file__).resolve().parent / "data"
DIALOGUES = DATA / "dialogues.json"  # voice-agent turns over the four demo businesses (bench llm, batch, voice)
QUALITY = DATA / "quality.json"  # fact-checked questions (bench quality)
BOOKING_DIALOGUES = DATA / "booking_dialogues.json"  # booking dialogues (bench tools, constrained)
RESULTS = Path(__file__).resolve().parent / "results"  # the saved runs the README quotes


def speech_dir() -> Path:
    """The LJ Speech clips: $SPECVOICE_SPEECH_DATA, else ../shared/data/speech beside the repo."""
    import os

    env = os.environ.get("SPECVOICE_SPEECH_DATA")
    return Path(env) if env else ROOT / ".." / "shared" / "data" / "speech"


def report_header(benchmark: str, llm) -> dict:
    """The fields every model benchmark's JSON opens with: what ran, where, on which models
    (`llm`: the config's [llm] section)."""
    import platform
    import sys

    from llm.threads import cores

    return {
        "benchmark": f"specvoice bench {benchmark}",
        "command": "specvoice " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "torch_threads": cores(), "device": llm.device},
        "models": {"target": llm.target, "drafter": llm.drafter, "dtype": llm.dtype},
    }


def write_json(path: Path, results, default=None) -> None:
    """A benchmark's results as indented JSON at `path` (its folder made), and a line saying so."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=default) + "\n", encoding="utf-8")
    print(f"wrote {path}")
