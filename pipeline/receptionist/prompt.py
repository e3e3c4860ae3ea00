"""The one system prompt a call uses, and the tools it is offered.

The prompt is the business's facts (`business.facts_prompt`, built from [business] and the
[agent] prompt options) plus, when [tools] is enabled, how to use the tools or, with the
turn plan, how a reply starts."""

from __future__ import annotations

import json

from pipeline.config import Config
from pipeline.receptionist.business import rules_block
from pipeline.receptionist.plan import plan_prompt

__all__ = ["system_prompt", "tool_schemas", "tool_values"]


def system_prompt(config: Config) -> str:
    """The system prompt a call uses: the agent's, plus how to use the tools when [tools]
    is enabled (the chat template adds the schemas; this says when to call them). With the
    default 1.5B target the schemas alone were not enough: asked to book, it answered from
    the facts, wrote the call as prose, or inside <tools> tags; with this paragraph it
    called book_slot and said the result."""
    if not config.tools.enabled:
        return config.agent.system_prompt
    if config.tools.plan:
        # The plan replaces tool calls (pipeline/receptionist/plan.py): the facts and rules as without
        # tools, then how a reply starts. No schemas: ~800 prompt tokens fewer.
        return f"{config.agent.system_prompt}\n\n{plan_prompt(config.business.open_slots or [])}"
    base, a = config.agent.system_prompt, config.agent
    rules = ""
    if a.prompt_rules and base == a.built_prompt(config.business):
        # The rules go after the tools paragraph, as rules for questions. Before it (as in a
        # prompt without tools) they made the 1.5B answer booking requests with the fixed
        # sentence; dropped, it made false claims on 39% of bench quality's questions. After
        # it: 9% false claims and more dialogues booked right (bench quality / bench tools,
        # README). A prompt the user wrote is kept as written.
        base = a.model_copy(update={"prompt_rules": False}).built_prompt(config.business)
        rules = "\n\n" + rules_block(config.business, questions_only=True)
    slots = config.business.open_slots or []
    example = json.dumps({"name": "book_slot", "arguments": {
        "slot": slots[-1] if slots else "Monday 9:00 a.m.", "name": "Jo Park"}}, ensure_ascii=False)
    return (f"{base}\n\nTools: when the caller wants to book a slot, cancel a booking, "
            "leave a message or speak to a person, reply with only the tool call, for example:\n"
            f"<tool_call>\n{example}\n</tool_call>\n"
            "After the tool's result, tell the caller in one short sentence what it says." + rules)


def tool_values(config: Config) -> dict[str, list[str]]:
    """Strings a tool argument takes, for drafting calls (llm/call_drafter.py): the
    business's slot labels, which book_slot's and cancel_booking's "slot" copy."""
    return {"slot": list(config.business.open_slots or [])}


def tool_schemas(config: Config) -> list[dict] | None:
    """The tools the model is offered: the receptionist's, when [tools] is enabled."""
    if not config.tools.enabled or config.tools.plan:
        return None
    from pipeline.receptionist.tools import TOOL_SCHEMAS

    return TOOL_SCHEMAS
