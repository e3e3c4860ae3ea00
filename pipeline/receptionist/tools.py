"""The receptionist's tools: what the model may call during a call, and what each does.

`TOOL_SCHEMAS` is the OpenAI "tools" list (the Qwen2.5 chat template takes the same
entries). Each tool's parameters are a pydantic model; the JSON schema the model sees is
generated from that model, so what the model is told and what is checked cannot drift.

`ToolBox(store, call_id, caller).run(name, arguments)` runs one call and never raises:
bad JSON, an unknown tool, missing or wrong-type arguments, a refused booking and a tool
that fails all come back as `ToolOutcome(ok=False, error=<a sentence for the model>)`.
It is synchronous (database I/O); the turn runs it in a thread.

Tools and what they do:
- check_slots(day?)                      the open slots, all or on one day ("Tuesday", "tue", "Dr. Patel")
- book_slot(slot, name, phone?)          books a slot; the name is stored exactly as given
- cancel_booking(name, slot? | booking_id?)  cancels the caller's active booking (the name must match,
                                          case and spaces aside); the slot opens again
- take_message(name, text, callback?)    stores a message for the staff
- transfer_to_human(reason)              action="transfer": the call is handed to a person after this turn
- end_call()                             action="end_call": the call ends after this turn
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.receptionist.bookings import BookingError, BookingStore, same_name

__all__ = ["TOOL_SCHEMAS", "TOOLS", "ToolBox", "ToolOutcome", "WRITES", "stays_done", "tool_schema"]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- arguments, one model per tool


class _Args(BaseModel):
    # Unknown keys are errors: a misspelt "phone_number" must not be silently dropped.
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _blank_optional_is_left_out(cls, data):
        # Models write "phone": "" for a number the caller never gave: that is "left out".
        # Refused, the 1.5B gave up on the booking instead of calling again (bench tools: 5
        # of 26 dialogues). A blank *required* argument is still an error (below).
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (
                isinstance(v, str) and not v.strip() and k in cls.model_fields and not cls.model_fields[k].is_required())}
        return data

    @field_validator("*")
    @classmethod
    def _not_blank(cls, value, info):
        if isinstance(value, str) and not value.strip():
            raise ValueError(f"{info.field_name} is empty; give a value or leave it out")
        return value


# The name a booking or a message is made under (both tools ask for it the same way).
CallerName = Annotated[str, Field(description="the caller's name, spelled as the caller said it")]


class CheckSlots(_Args):
    """List the open appointment slots. Call this before offering or booking a time."""

    day: str | None = Field(default=None, description="only slots on this day, e.g. 'Tuesday'; leave out for all")


class BookSlot(_Args):
    """Book an open appointment slot for the caller."""

    slot: str = Field(description="the slot exactly as check_slots listed it, e.g. 'Tuesday 10:30 a.m. with Dr. Patel'")
    name: CallerName
    phone: str | None = Field(default=None, description="a phone number to reach the caller, if given")


class CancelBooking(_Args):
    """Cancel the caller's booking, named by its slot or its booking id, under the caller's name."""

    name: str = Field(description="the name the booking was made under")
    slot: str | None = Field(default=None, description="the booked slot, e.g. 'Friday 9:00 a.m. with Dr. Patel'")
    booking_id: int | None = Field(default=None, description="the booking id, if the caller has it")

    @model_validator(mode="after")
    def _which_booking(self) -> CancelBooking:
        if self.slot is None and self.booking_id is None:
            raise ValueError("give the slot or the booking_id of the booking to cancel")
        return self


class TakeMessage(_Args):
    """Take a message for the staff when you cannot help the caller yourself."""

    name: CallerName
    text: str = Field(description="the message, in the caller's words")
    callback: str | None = Field(default=None, description="a phone number or time to call back, if given")


class TransferToHuman(_Args):
    """Transfer the call to a person at the business."""

    reason: str = Field(description="why the caller needs a person, in a few words")


class EndCall(_Args):
    """End the call, after saying goodbye."""


@dataclass(frozen=True)
class _Tool:
    name: str
    arguments: type[_Args]
    handler: Callable[[ToolBox, Any], dict]


def _plain_schema(node: Any) -> Any:
    """pydantic's JSON schema, trimmed to what a model needs: no titles, and an optional
    field as its plain type (`anyOf [string, null]` -> `string`, no `default: null`)."""
    if isinstance(node, list):
        return [_plain_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _plain_schema(value) for key, value in node.items() if key != "title"}
    options = out.get("anyOf")
    if isinstance(options, list) and len(options) == 2 and {"type": "null"} in options:
        (kept,) = [o for o in options if o != {"type": "null"}]
        out.pop("anyOf")
        out = {**kept, **out}
        if out.get("default", 0) is None:
            out.pop("default")
    return out


def tool_schema(name: str, arguments: type[_Args]) -> dict:
    """One OpenAI "tools" entry from a tool's argument model."""
    parameters = _plain_schema(arguments.model_json_schema())
    parameters.setdefault("properties", {})
    parameters["type"] = "object"
    parameters["additionalProperties"] = False
    parameters.pop("description", None)  # the docstring is the tool's description below
    description = " ".join((arguments.__doc__ or "").split())
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


# ---------------------------------------------------------------- outcomes


@dataclass(frozen=True)
class ToolOutcome:
    name: str
    arguments: dict
    ok: bool
    result: dict | None  # JSON-able; the tool message the model reads back
    error: str | None  # a sentence for the model when ok is False
    elapsed_ms: float
    action: Literal["transfer", "end_call"] | None = None  # what the call must do after this turn
    reason: str | None = None  # why (transfer_to_human's reason)

    def as_dict(self) -> dict:
        return asdict(self)

    def content(self) -> str:
        """The tool message's content: the result, or the error, as JSON."""
        return json.dumps(self.result if self.ok else {"error": self.error}, ensure_ascii=False)


# ---------------------------------------------------------------- the tools


def _check_slots(box: ToolBox, args: CheckSlots) -> dict:
    found = box.store.open_slots(args.day)
    result: dict = {"open_slots": found}
    if args.day is not None:
        result["day"] = args.day
        if not found:
            others = box.store.open_slots()
            result["note"] = (f"no open slots for '{args.day}'; other open slots: {'; '.join(others)}" if others
                              else "no open slots at all; offer to take a message")
    return result


def _book_slot(box: ToolBox, args: BookSlot) -> dict:
    booking = box.store.book(args.slot, args.name, args.phone, call_id=box.call_id, caller=box.caller)
    return {"booked": True, "booking_id": booking.id, "slot": booking.slot, "name": booking.name,
            "phone": booking.phone}


def _cancel_booking(box: ToolBox, args: CancelBooking) -> dict:
    booking = box.store.cancel(args.name, slot=args.slot, booking_id=args.booking_id)
    return {"cancelled": True, "booking_id": booking.id, "slot": booking.slot, "name": booking.name,
            "slot_open_again": True}


def _take_message(box: ToolBox, args: TakeMessage) -> dict:
    message = box.store.add_message(args.name, args.text, args.callback, call_id=box.call_id, caller=box.caller)
    return {"message_taken": True, "message_id": message.id, "name": message.name}


def _transfer_to_human(box: ToolBox, args: TransferToHuman) -> dict:
    return {"transferring": True, "reason": args.reason}


def _end_call(box: ToolBox, args: EndCall) -> dict:
    return {"ending_call": True}


TOOLS: dict[str, _Tool] = {t.name: t for t in (
    _Tool("check_slots", CheckSlots, _check_slots),
    _Tool("book_slot", BookSlot, _book_slot),
    _Tool("cancel_booking", CancelBooking, _cancel_booking),
    _Tool("take_message", TakeMessage, _take_message),
    _Tool("transfer_to_human", TransferToHuman, _transfer_to_human),
    _Tool("end_call", EndCall, _end_call),
)}

TOOL_SCHEMAS: list[dict] = [tool_schema(t.name, t.arguments) for t in TOOLS.values()]

_ACTIONS: dict[str, Literal["transfer", "end_call"]] = {"transfer_to_human": "transfer", "end_call": "end_call"}
# The tools that change the database: a turn whose call of one succeeded did something that
# stays done (it is never taken back: pipeline/stages/take_back.py), as is an action to come.
WRITES = frozenset({"book_slot", "cancel_booking", "take_message"})


def stays_done(name: str | None, ok: bool, action: str | None) -> bool:
    """Whether a tool run changed something the caller would have to undo: a booking, a
    cancellation or a message written, or a transfer or hang-up to come. Reading the
    slots, or a refused call, changes nothing (the plan step and the tool-call step alike)."""
    return bool(ok) and (name in WRITES or action is not None)


def _validation_message(name: str, exc: ValidationError) -> str:
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "missing":
            problems.append(f"'{where}' is missing")
        elif err["type"] == "extra_forbidden":
            problems.append(f"'{where}' is not an argument of {name}")
        else:
            message = err["msg"].removeprefix("Value error, ")
            got = f" (got {json.dumps(err['input'], default=str)[:60]})" if where else ""
            problems.append(f"'{where}': {message}{got}" if where else message)
    fields = TOOLS[name].arguments.model_fields
    usage = ", ".join(f"{field} ({'required' if info.is_required() else 'optional'})" for field, info in fields.items())
    return f"bad arguments for {name}: {'; '.join(problems)}. Its arguments: {usage or 'none'}"


class ToolBox:
    """The tools of one call: bookings and messages are recorded with `call_id` and the
    line's caller ID (`caller`, when the transport knows it)."""

    def __init__(self, store: BookingStore, call_id: str, caller: str | None = None):
        self.store = store
        self.call_id = call_id
        self.caller = caller

    def open_slots(self) -> list[str]:
        """The slots free now, as the booking store has them."""
        return self.store.open_slots()

    def callers_bookings(self, name: str | None = None) -> list[str]:
        """The slots of the active bookings this caller holds: made on this call, under
        `name` (the name they gave, in any case), or from this line's caller ID. What the fact
        guard lets the agent say they have booked."""
        return [b.slot for b in self.store.bookings(include_cancelled=False)
                if b.call_id == self.call_id or (name and same_name(b.name, name)) or (self.caller and b.caller == self.caller)]

    def run(self, name: str, arguments: str | dict | None) -> ToolOutcome:
        """Run one tool call. Never raises: every failure is an outcome with ok=False and a
        sentence the model can act on."""
        start = time.perf_counter()

        def done(args: dict, ok: bool, result: dict | None = None, error: str | None = None) -> ToolOutcome:
            action = _ACTIONS.get(name) if ok else None
            reason = result.get("reason") if ok and result and action == "transfer" else None
            return ToolOutcome(str(name), args, ok, result, error, (time.perf_counter() - start) * 1000.0,
                               action, reason)

        try:
            args, problem = _parse_arguments(arguments)
            tool = TOOLS.get(name) if isinstance(name, str) else None
            if tool is None:
                return done(args, False, error=f"unknown tool '{name}'; the tools are: {', '.join(TOOLS)}")
            if problem:
                return done(args, False, error=f"{name}: {problem}")
            try:
                parsed = tool.arguments.model_validate(args)
            except ValidationError as exc:
                return done(args, False, error=_validation_message(tool.name, exc))
            try:
                return done(args, True, result=tool.handler(self, parsed))
            except BookingError as exc:  # refused for a reason the caller can act on
                return done(args, False, error=str(exc))
            except Exception as exc:  # the database or the tool failed: say so, keep the call up
                log.warning("tool %s failed: %r", name, exc, exc_info=True)
                return done(args, False, error=f"{name} could not be done ({type(exc).__name__}: {exc}); "
                                                "tell the caller and offer to take a message")
        except Exception as exc:  # a bug here must not take the call down either
            log.error("tool call %r crashed: %r", name, exc, exc_info=True)
            return done({}, False, error=f"{name} could not be done ({type(exc).__name__}: {exc})")


def _parse_arguments(arguments: str | dict | None) -> tuple[dict, str | None]:
    """The model's arguments -> (dict, problem). Empty means no arguments."""
    if arguments is None:
        return {}, None
    if isinstance(arguments, dict):
        return dict(arguments), None
    if not isinstance(arguments, str):
        return {"_raw": repr(arguments)[:200]}, f"arguments must be a JSON object, got {type(arguments).__name__}"
    if not arguments.strip():
        return {}, None
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as exc:
        return {"_raw": arguments[:500]}, f"arguments are not valid JSON ({exc.msg} at character {exc.pos}); " \
                                          "send one JSON object"
    if not isinstance(value, dict):
        return {"_raw": arguments[:500]}, f"arguments must be a JSON object, got {type(value).__name__}"
    return value, None
