"""`specvoice bench KIND`: benchmarks that print a table and write JSON (never tests)."""

from __future__ import annotations

import argparse

HELP = "benchmarks: llm, engine, voice, pipeline, endings, load, batch, quality, tools, constrained, web"
DESCRIPTION = """\
Benchmarks print their figures and write JSON (--out). Compare modes side by side in
one run: this machine is shared and noisy, so ratios measured together are what count.

  specvoice bench llm --out bench-llm.json        # our engine vs Hugging Face, real default pair
  specvoice bench engine --out engine.json        # controlled acceptance, random weights (GPU or CPU)
  specvoice bench voice --out voice.json          # STT / TTS / VAD real-time factors
  specvoice bench pipeline --out pipeline.json    # a scripted call, speculation on vs off
  specvoice bench endings --out endings.json      # does a pause end the turn: whole vs cut questions
  specvoice bench load --calls 1 2 4              # N simulated callers against one bridge
  specvoice bench batch --calls 1 2 4 --threads 1 # N conversations on one engine: batched vs one pass at a time
  specvoice bench quality --out quality.json      # % correct / % false claims on fact-checked questions
  specvoice bench tools --out tools.json          # booking dialogues: right final database state, right tool calls
  specvoice bench constrained --out c.json        # JSON tool calls / extraction: constrained with and without speculation
  specvoice bench web --out web.json              # voice to voice: the call page in Chromium vs the Twilio bridge
"""

# (name, module): each module has HELP, DESCRIPTION, add_arguments(parser), run(args).
BENCHES: list[tuple[str, str]] = [
    ("llm", "bench.llm"),
    ("engine", "bench.engine"),
    ("voice", "bench.voice"),
    ("pipeline", "bench.pipeline"),
    ("endings", "bench.endings"),
    ("load", "bench.load"),
    ("batch", "bench.batch"),
    ("quality", "bench.quality"),
    ("tools", "bench.tools"),
    ("constrained", "bench.constrained"),
    ("web", "bench.web"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="KIND")
    from demo.cli import add_subcommands

    add_subcommands(sub, BENCHES, "_bench_run")


def run(args: argparse.Namespace) -> int:
    if not getattr(args, "_bench_run", None):
        print(DESCRIPTION)
        return 2
    return int(args._bench_run(args) or 0)
