"""`specvoice generate`: the LLM stage alone, from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = "run the speculative LLM stage alone on a prompt or chat messages"
DESCRIPTION = """\
Generate with the speculative decoder and print text as each target pass's group of
tokens arrives. Models default to the config's (the embedded default after
`specvoice models pull`); --target/--draft take a catalog name, a Hugging Face id, a
local directory or a GGUF file.

examples:
  specvoice generate --prompt "The clinic opens at"                       # raw text, no chat template
  specvoice generate --messages chat.json --drafter ngram --gamma 4
  specvoice generate --prompt "Hi" --gamma 0 --json                       # plain decoding, JSON out
  specvoice generate --messages chat.json --temperature 0.8 --top-p 0.9 --seed 7

constrained (every token masked to what the constraint allows; exact under speculation,
and the tokens it forces are drafted for free):
  specvoice generate --messages chat.json --json-schema booking.schema.json
  specvoice generate --prompt "Open on Monday? Answer:" --regex " (Yes|No), we (are|are not) open\\."
  specvoice generate --messages chat.json --grammar plan.lark       # Lark, as llguidance reads it

chat.json is a list of {"role": "system"|"user"|"assistant", "content": "..."}.
With --json the output is one object: token_ids, groups (lists of ids), text, stats
(with forced_tokens: how many tokens the constraint left no choice for).
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text, used as is (no chat template)")
    src.add_argument("--messages", type=Path, help="JSON file with a list of chat messages")
    p.add_argument("--config", help="config name or TOML file (default: configs/default.toml)")
    p.add_argument("--target", help="target model (default: the config's llm.target)")
    p.add_argument("--draft", help="draft model (default: the config's llm.draft)")
    p.add_argument("--drafter", choices=["model", "ngram", "hybrid", "none"], help="who proposes drafts")
    p.add_argument("--gamma", help="drafts per pass: an integer >= 0, or 'auto' (adaptive)")
    p.add_argument("--max-gamma", type=int, help="upper bound for the adaptive gamma")
    p.add_argument("--device", help="cpu or cuda")
    p.add_argument("--dtype", choices=["auto", "int8", "float32", "bfloat16", "float16"])
    p.add_argument("--max-new-tokens", type=int)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="argmax decoding (the default)")
    mode.add_argument("--temperature", type=float, help="sample at this temperature (> 0)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", type=Path, metavar="FILE", help="write JSON that this JSON schema file allows")
    shape.add_argument("--regex", metavar="R", help="write text that this regular expression matches as a whole")
    shape.add_argument("--grammar", type=Path, metavar="FILE", help="write text of this Lark grammar (start rule: start)")


def read_constraint(args: argparse.Namespace):
    """The --json-schema / --regex / --grammar constraint, or None; SystemExit(2) with the
    file's problem when it cannot be read."""
    from llm.types import Constraint

    if args.regex is not None:
        return Constraint.regex(args.regex)
    for path, kind in ((args.json_schema, "json_schema"), (args.grammar, "grammar")):
        if path is None:
            continue
        try:
            text = path.read_text()
        except OSError as exc:
            raise SystemExit(f"error: cannot read {path}: {exc.strerror or exc}")
        if kind == "json_schema":
            try:
                json.loads(text)
            except json.JSONDecodeError as exc:
                raise SystemExit(f"error: {path} is not JSON ({exc}); --json-schema takes a JSON schema file")
        try:
            return Constraint(kind, text)
        except ValueError as exc:
            raise SystemExit(f"error: {path}: {exc}")
    return None


def parse_gamma(value: str | None, default):
    if value is None:
        return default
    if value == "auto":
        return "auto"
    try:
        g = int(value)
    except ValueError:
        raise SystemExit(f"error: --gamma must be an integer >= 0 or 'auto', got {value!r}")
    if g < 0:
        raise SystemExit(f"error: --gamma must be >= 0 (0 turns speculation off), got {g}")
    return g


def run(args: argparse.Namespace) -> int:
    from pipeline.config import ConfigError, load_config

    try:
        cfg = load_config(args.config).llm
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    gamma = parse_gamma(args.gamma, cfg.gamma)
    if args.temperature is not None and args.temperature <= 0:
        print("error: --temperature must be > 0 (use --greedy for argmax)", file=sys.stderr)
        return 2
    messages = None
    if args.messages:
        try:
            messages = json.loads(args.messages.read_text())
            assert isinstance(messages, list) and all("role" in m and "content" in m for m in messages)
        except (OSError, json.JSONDecodeError, AssertionError) as exc:
            print(f"error: {args.messages} must be a JSON list of {{role, content}} messages ({exc})", file=sys.stderr)
            return 2

    try:
        constraint = read_constraint(args)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2

    from llm.engine import SpeculativeEngine
    from llm.loading import ModelLoadError, TokenizerMismatchError
    from llm.types import SamplingParams
    from modelstore import ModelNotFoundError, resolve_model

    drafter = args.drafter or cfg.drafter
    try:
        target = resolve_model(args.target or cfg.target)
        draft_name = args.draft or cfg.draft
        draft = resolve_model(draft_name) if draft_name and drafter in ("model", "hybrid") else None
        engine = SpeculativeEngine.load(
            target, draft, drafter=drafter, gamma=gamma, max_gamma=args.max_gamma or cfg.max_gamma,
            device=args.device or cfg.device, dtype=args.dtype or cfg.dtype, context_tokens=cfg.context_tokens,
        )
    except (ModelNotFoundError, ModelLoadError, TokenizerMismatchError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    temperature = args.temperature if args.temperature is not None else (0.0 if args.greedy else cfg.temperature)
    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens or cfg.max_new_tokens, temperature=temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed if args.seed is not None else cfg.seed,
            stop=tuple(args.stop or cfg.stop), constraint=constraint,
        )
        prompt = engine.chat_prompt(messages) if messages is not None else engine.encode(args.prompt)
        if not prompt:
            raise ValueError("the prompt is empty")
        conv = engine.new_conversation(params.seed)
        groups = []
        for group in engine.stream(prompt, params, conv):
            groups.append(group)
            if not args.json:
                sys.stdout.write(group.text)
                sys.stdout.flush()
    except ValueError as exc:  # a constraint that does not compile is a ConstraintError (a ValueError)
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    ids = [t for g in groups for t in g.token_ids]
    engine_stats = conv.last_stats.as_dict()
    if args.json:
        print(json.dumps({
            "token_ids": ids,
            "groups": [list(g.token_ids) for g in groups],
            "text": "".join(g.text for g in groups),
            "finish_reason": groups[-1].finish_reason if groups else None,
            "stats": engine_stats,
        }))
    else:
        s = engine_stats
        print(
            f"\n[{s['new_tokens']} tokens in {s['passes']} target passes: {s['tokens_per_pass']:.2f}/pass, "
            f"acceptance {s['acceptance_rate']:.2f}, {s['tokens_per_s']:.2f} tokens/s, "
            f"TTFT {s['ttft_s']:.3f}s, finish {groups[-1].finish_reason}"
            + (f", {s['forced_tokens']} tokens forced by the constraint" if constraint is not None else "") + "]",
            file=sys.stderr,
        )
    return 0
