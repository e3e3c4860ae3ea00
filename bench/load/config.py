"""The configs the load benchmark runs: in process (`load_bench_config`: the small setup
unless --config), and each spawned `specvoice serve` process's (`spawn_config`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SMALL = "smollm2-135m-instruct"


def load_bench_config(args: argparse.Namespace, report_dir: Path):
    """The in-process bridge's config: --config as is, else the `test` setup with SmolLM2-135M
    (int8, n-gram drafter) and whisper-tiny.en; reports in `report_dir`, no MQTT."""
    from pipeline.config import load_config

    if args.config:
        cfg = load_config(args.config)
    else:
        cfg = load_config("test")
        cfg = cfg.model_copy(update={
            "llm": cfg.llm.model_copy(update={"target": SMALL, "draft": None, "drafter": "ngram", "dtype": "int8",
                                              "gamma": 4, "temperature": 0.0, "threads": agent_threads(args)}),
            "stt": cfg.stt.model_copy(update={"model": "whisper-tiny.en"}),
        })
    if args.stt_workers:
        cfg = cfg.model_copy(update={"stt": cfg.stt.model_copy(update={"workers": args.stt_workers})})
    return cfg.model_copy(update={
        "llm": cfg.llm.model_copy(update={"max_new_tokens": args.max_new_tokens}),
        "report": cfg.report.model_copy(update={"dir": str(report_dir)}),
        "mqtt": cfg.mqtt.model_copy(update={"enabled": False}),
    })


def agent_threads(args: argparse.Namespace) -> int | None:
    """The `threads` AgentModels.load gets: --threads; else, with --config, None (the config's
    own, as `specvoice serve` runs it: torch on every core); the small setup: 1."""
    return args.threads if args.threads or args.config else 1


def threads_used(args: argparse.Namespace, cfg) -> dict[str, int]:
    """Threads of torch, the STT and Piper, as the benchmark ran them (its JSON, its header)."""
    from pipeline.agent import thread_counts

    return dict(zip(("torch", "stt", "piper"), thread_counts(cfg, agent_threads(args))))


def spawn_config(args: argparse.Namespace, path: Path, llm_url: str, llm_name: str, report_dir: Path,
                 max_calls: int) -> Path:
    """A serve config on top of --config (or the small `test` setup with whisper-tiny.en, as
    the in-process benchmark uses): backend openai against the one LLM server, this process's
    report folder, max_calls, no MQTT."""
    base = args.config or "test"
    if Path(base).suffix:
        base = str(Path(base).resolve())
    stt = "" if args.config else '[stt]\nmodel = "whisper-tiny.en"\n\n'
    path.write_text(f"""base = {json.dumps(base)}

[llm]
backend = "openai"
max_new_tokens = {args.max_new_tokens}
temperature = 0.0
seed = 0

[llm.openai]
base_url = {json.dumps(llm_url)}
model = {json.dumps(llm_name)}
timeout_s = 120

{stt}[report]
dir = {json.dumps(str(report_dir))}

[bridge]
max_calls = {max_calls}

[mqtt]
enabled = false
""")
    return path

