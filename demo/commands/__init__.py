"""The subcommands of `specvoice` (one module each, see demo/cli.py) and what they share."""

from __future__ import annotations

import sys


def load_config_or_exit(name: str | None, prog: str):
    """The validated config, or its error printed as `prog: ...` and exit status 2."""
    from pipeline.config import ConfigError, load_config

    try:
        return load_config(name)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def load_models_or_exit(config, prog: str, **kwargs):
    """The agent's models (LLM, Whisper, Piper, VAD), or why not and exit status 1: a
    missing model's error names the pull command."""
    from pipeline.agent import AgentModels
    from modelstore import ModelNotFoundError

    print("loading models...", file=sys.stderr, flush=True)
    try:
        return AgentModels.load(config, **kwargs)
    except (ModelNotFoundError, OSError, RuntimeError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
