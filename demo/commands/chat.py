"""`specvoice chat`: the agent's turn loop in text, to try a business file before a phone line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = "text chat with the agent: the call's turn loop (history, tools, fact guard) without STT or TTS"
DESCRIPTION = """\
Talk to the agent in text. Each line you type is a caller's turn through the same loop a
phone call runs: the same system prompt (its K/V computed once and reused), the
conversation history, the tools on the config's database when [tools] is enabled, the
hold line, and the fact guard on every sentence. What is printed is what the caller would
hear. Use it to try a business file before you put it on a phone line.

  specvoice chat --config mybusiness.toml                      # interactive; an empty line or Ctrl-D ends it
  specvoice chat --config mybusiness.toml --script calls.json  # scripted conversations
  specvoice chat --config mybusiness.toml --script calls.json --json       # one JSON line per turn

A script is a JSON list of conversations, each a list of caller lines; a plain list of
strings is one conversation:

  [["Are you open on Sunday?", "And Saturday?"],
   ["Can I book the Tuesday slot? I'm Ann Lee.", "Actually, cancel that."]]

Each conversation starts a fresh history (a new caller); all of them share the config's
database, so a slot booked in one is taken in the next. A tool that ends the call
(transfer, end_call) ends that conversation.

--json prints one JSON object per turn and nothing else on stdout:

  {"conversation": 0, "turn": 0, "caller": "...", "agent": "...",
   "tools": [{"name": "book_slot", "arguments": {...}, "result": {...}}],
   "guarded": [{"sentence": "...", "why": "...", "said": "..."}], "first_sentence_ms": 812.4, ...}

"guarded" lists the model's sentences the fact guard did not let through, why, and what
was said instead; "first_sentence_ms" is from the LLM request to the first sentence.
A business file with a mistake is refused with the field named (exit status 2).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="config name or TOML file: the business, models, [tools] (default: configs/default.toml)")
    parser.add_argument("--script", type=Path, help="JSON: a list of conversations, each a list of caller lines "
                                                    "(or one list of lines); default: interactive")
    parser.add_argument("--json", action="store_true", help="one JSON object per turn on stdout, nothing else")
    parser.add_argument("--no-greeting", action="store_true", help="the agent does not greet (it is not in the history)")


def read_script(path: Path) -> list[list[str]]:
    """Conversations of caller lines; ValueError saying what is wrong with the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if isinstance(data, list) and data and all(isinstance(x, str) for x in data):
        data = [data]
    if not (isinstance(data, list) and data and all(
            isinstance(c, list) and c and all(isinstance(x, str) and x.strip() for x in c) for c in data)):
        raise ValueError(f"{path}: expected a list of conversations, each a non-empty list of caller lines "
                         '(or one list of lines), e.g. [["Are you open Sunday?"], ["Book Tuesday, I\'m Ann."]]')
    return data


def run(args: argparse.Namespace) -> int:
    import asyncio

    from demo.commands import load_config_or_exit

    config = load_config_or_exit(args.config, "specvoice chat")
    conversations = None
    if args.script is not None:
        try:
            conversations = read_script(args.script)
        except ValueError as exc:
            print(f"specvoice chat: {exc}", file=sys.stderr)
            return 2
    elif args.json:
        print("specvoice chat: --json needs --script (interactive chat prints text)", file=sys.stderr)
        return 2
    models = load_agent(config)
    try:
        return asyncio.run(_chat(config, models, conversations, args))
    finally:
        if models.bookings is not None:
            models.bookings.close()


def load_agent(config):
    """The language model and the database of `config`, without Whisper or Piper: what a
    call's turn loop uses (the system prompt's K/V computed once, as a call's)."""
    from pipeline.agent import AgentModels, load_engine, open_bookings
    from pipeline.receptionist.bookings import DatabaseError
    from modelstore import ModelNotFoundError

    print("loading the language model...", file=sys.stderr, flush=True)
    try:
        bookings = open_bookings(config)
        engine = load_engine(config.llm) if config.llm.backend == "speculative" else None
    except (DatabaseError, ModelNotFoundError, OSError, RuntimeError, ValueError) as exc:
        print(f"specvoice chat: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    models = AgentModels(config, None, None, None, engine, None, {}, bookings)
    models.warm()
    return models


async def _chat(config, models, conversations, args) -> int:
    from pipeline.conversation import TextConversation
    from pipeline.receptionist.guard import FactGuard

    guard = FactGuard(config.business) if config.agent.guard else None
    greeting = "" if args.no_greeting else config.agent.greeting

    def new_conversation(i: int) -> TextConversation:
        return TextConversation(config, models.new_backend(config), models.count_tokens,
                                toolbox=models.new_toolbox(f"chat-{i}"), guard=guard, greeting=greeting)

    if conversations is None:
        return await _interactive(new_conversation(0), greeting)
    for i, lines in enumerate(conversations):
        conv = new_conversation(i)
        if greeting and not args.json:
            print(f"\n--- conversation {i} ---\nagent: {greeting}")
        for line in lines:
            turn = await conv.turn(line)
            if args.json:
                print(json.dumps({"conversation": i, **turn.as_dict()}, ensure_ascii=False, default=str), flush=True)
            else:
                _print_turn(turn, show_caller=True)
            if conv.ended:
                print(f"specvoice chat: conversation {i} ended by the agent ({conv.ended}) after turn {turn.index}",
                      file=sys.stderr)
                break
        await _close(conv.backend)
    return 0


async def _interactive(conv, greeting: str) -> int:
    import asyncio

    if greeting:
        print(f"agent: {greeting}")
    while not conv.ended:
        try:
            line = await asyncio.to_thread(input, "you: ")
        except EOFError:
            print()
            break
        if not line.strip():
            break
        _print_turn(await conv.turn(line.strip()), show_caller=False)
    await _close(conv.backend)
    return 0


def _print_turn(turn, show_caller: bool) -> None:
    if show_caller:
        print(f"caller: {turn.caller}")
    for call in turn.tools():
        print(f"  [tool] {call['name']} {json.dumps(call['arguments'], ensure_ascii=False, default=str)} -> "
              f"{json.dumps(call['result'], ensure_ascii=False, default=str)}")
    for g in turn.result.guarded:
        print(f"  [guard] not said: {g['sentence']!r} ({g['why']})")
    ms = turn.first_sentence_ms
    print(f"agent: {turn.agent}" + (f"   ({ms:.0f} ms to the first sentence)" if ms is not None else ""), flush=True)


async def _close(backend) -> None:
    close = getattr(backend, "aclose", None)
    if close is not None:
        await close()
