"""`specvoice report`: a call report (JSON) as a terminal summary and one HTML page."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "latency report of one or more calls: terminal summary + self-contained HTML"
DESCRIPTION = """\
Read call reports (JSON written by every call, under report.dir), print a one-screen
summary, and write one self-contained HTML page (no external resources) with the
latency summary, a waterfall per turn, voice-to-voice over the call and the
transcripts. With several reports, both add a comparison table.

A call with a recording beside its report (CALL.wav: `specvoice call` and calls from the
page of `specvoice serve` write one) gets a player on the page; a click on a turn plays it.

A call that used tools (bookings, messages, transfer) also gets a tools line in the
summary (calls, failures, voice to voice of turns with a tool call apart from the
others) and, on the page, each tool call as a bar in its turn's waterfall (a failed one
red, its error in the tooltip) and a table: name, arguments, result or error, ms.

  specvoice report reports/call-123.json                 # writes reports/call-123.html
  specvoice report a.json b.json --html compare.html --open
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reports", nargs="+", metavar="CALL.json", help="call report JSON file(s)")
    parser.add_argument("--html", metavar="OUT.html",
                        help="where to write the page (default: next to the first JSON; comparison.html for several)")
    parser.add_argument("--no-html", action="store_true", help="only print the terminal summary")
    parser.add_argument("--open", action="store_true", help="open the page in a web browser")


def default_html_path(paths: list[Path]) -> Path:
    if len(paths) == 1:
        return paths[0].with_suffix(".html")
    return paths[0].parent / "comparison.html"


def recording_link(paths: list[Path], out: Path) -> str | None:
    """The call's recording (the stereo WAV beside its report: `specvoice call` and browser
    calls write one) as a link from the page, which then plays it; one report only."""
    import os

    if len(paths) != 1 or not paths[0].with_suffix(".wav").is_file():
        return None
    wav = paths[0].with_suffix(".wav").resolve()
    return Path(os.path.relpath(wav, out.resolve().parent)).as_posix()


def run(args: argparse.Namespace) -> int:
    from demo.report_html import ReportError, load_report, text_comparison, text_summary, write_html

    paths = [Path(p) for p in args.reports]
    try:
        reports = [load_report(p) for p in paths]
    except ReportError as exc:
        print(f"specvoice report: {exc}", file=sys.stderr)
        return 2
    for report in reports:
        print(text_summary(report))
        print()
    if len(reports) > 1:
        print(text_comparison(reports))
        print()
    if args.no_html:
        return 0
    out = Path(args.html) if args.html else default_html_path(paths)
    recording = recording_link(paths, out)
    try:
        write_html(reports, out, recording)
    except OSError as exc:
        print(f"specvoice report: cannot write {out}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    if args.open:
        import webbrowser

        webbrowser.open(out.resolve().as_uri())
    return 0
