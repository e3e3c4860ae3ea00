"""Faults during a call, over real WebSockets through the real bridge, telephony adapter
and pipeline Call (models replaced by quick stand-ins from callfakes so each fault is
placed exactly). In every case: the bridge keeps serving (a second call after the fault
is answered), nothing of the broken call is left running (asyncio tasks, threads, voice
workers, the LLM stream), and its report is written, saying how the call ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from websockets.exceptions import ConnectionClosed

from callfakes import (
    FakeModels,
    RawCaller,
    ScriptedBackend,
    ScriptedSTT,
    ToneTTS,
    a_good_call,
    agent_bridge,
    assert_released,
    rel_config,
    report_of,
    snapshot,
    wait_for,
)
from callsteps import answered_then_hung_up

pytestmark = pytest.mark.timeout(60)


class CountingBackend(ScriptedBackend):
    """A ScriptedBackend that counts the groups it has handed out."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.yielded = 0

    async def stream(self, messages, params, cancel=None):
        inner = super().stream(messages, params, cancel)
        try:
            async for group in inner:
                self.yielded += 1
                yield group
        finally:
            await inner.aclose()


async def _started(models: FakeModels, n: int = 1) -> ScriptedBackend:
    await wait_for(lambda: len(models.backends) >= n and models.backends[n - 1].started.is_set(), 10, "the LLM")
    return models.backends[n - 1]


@contextlib.asynccontextmanager
async def one_call(cfg, models: FakeModels):
    """The bridge with one caller on the line: (bridge, port, caller). On leaving, nothing
    of the calls made meanwhile is left running (tasks, threads, voice work)."""
    async with agent_bridge(cfg, models) as (bridge, port, handler):
        before = snapshot()
        c = await RawCaller(port).open()
        yield bridge, port, c
        await assert_released(before)


# ---------------------------------------------------------------- the caller goes away


async def test_disconnect_mid_utterance(tmp_path):
    cfg = rel_config(tmp_path)
    models = FakeModels()
    async with agent_bridge(cfg, models) as (bridge, port, handler):
        before = snapshot()
        c = await RawCaller(port).open()
        from callfakes import tone_mulaw

        await c.send_audio(tone_mulaw(0.4))  # speaking... and the line drops
        await c.abort()
        data = await report_of(cfg, c.call_sid)
        assert data["end_reason"] == "caller_hangup", data["end_reason"]
        # Nobody is listening any more: the half utterance is not answered.
        assert data["turns"] == [] and data["error"] is None
        assert models.stt.calls == 0 and not models.backends[0].opened
        await a_good_call(port, cfg)
        await assert_released(before)
        assert bridge.active_calls == 0 and not bridge.calls


async def test_disconnect_mid_llm(tmp_path):
    cfg = rel_config(tmp_path)
    groups = ["Let me see. "] + ["and so on "] * 40
    models = FakeModels(backend=lambda: CountingBackend(groups, delay_s=0.1))
    async with one_call(cfg, models) as (bridge, port, c):
        await c.say()
        backend = await _started(models)
        # The LLM is mid-answer: its first sentence and more are out, 3.8 s of groups to go.
        await wait_for(lambda: backend.yielded >= 3, 10, "the LLM to be mid-answer")
        await c.abort()
        data = await report_of(cfg, c.call_sid)
        assert data["end_reason"] == "caller_hangup"
        (turn,) = data["turns"]
        assert turn["user_text"] and turn["agent_text"].startswith("Let me see")
        assert backend.closed == backend.opened == 1  # the stream was closed, not left generating
        # Stopped at the hang-up, not run to the end of its 41 groups (4 s).
        assert backend.yielded < len(groups)
        assert len(turn["agent_text"]) < len("".join(groups))
        models.backend = ScriptedBackend
        await a_good_call(port, cfg)


async def test_disconnect_mid_tts(tmp_path):
    cfg = rel_config(tmp_path)
    tts = ToneTTS(chunks=20, chunk_s=0.1, delay_s=0.1)  # 2 s of synthesis work per sentence
    models = FakeModels(tts=tts)
    async with one_call(cfg, models) as (bridge, port, c):
        await c.say()
        await wait_for(lambda: c.media_in > 0, 10, "agent audio")
        assert tts.active == 1  # synthesis in progress
        await c.abort()
        data = await report_of(cfg, c.call_sid)
        assert data["end_reason"] == "caller_hangup" and len(data["turns"]) == 1
        await wait_for(lambda: tts.active == 0, 5, "the TTS worker to stop")
        tts.delay_s = 0.0
        await a_good_call(port, cfg)


async def test_stop_never_sent_clean_close(tmp_path):
    cfg = rel_config(tmp_path)
    models = FakeModels()
    async with one_call(cfg, models) as (bridge, port, c):
        await c.say()
        assert await c.wait_reply()
        await c.close()  # WebSocket close frame, but no `stop`
        data = await report_of(cfg, c.call_sid)
        assert data["end_reason"] == "caller_hangup" and len(data["turns"]) == 1
        await a_good_call(port, cfg)


async def test_stop_never_sent_and_line_goes_silent_idle_timeout(tmp_path, caplog):
    """The peer keeps the socket open but sends nothing: the idle timeout ends the call."""
    cfg = rel_config(tmp_path, idle_timeout_s=1.0)
    models = FakeModels()
    async with one_call(cfg, models) as (bridge, port, c):
        await c.say()
        assert await c.wait_reply()
        # ... and then nothing: no media, no stop.
        assert await c.wait_closed(10) == 1000 and c.ws.close_reason == "idle timeout"
        data = await report_of(cfg, c.call_sid)
        assert data["end_reason"] == "idle_timeout" and len(data["turns"]) == 1
        assert "no message for 1.0 s" in caplog.text
        await a_good_call(port, cfg)


async def test_slow_reader_stalled_socket(tmp_path):
    """A peer that stops reading while the agent talks: the pipeline does not block on it
    (mark waits time out), other calls are served meanwhile, and once the line goes quiet
    the idle timeout hangs up even though the peer never reads the close frame."""
    cfg = rel_config(tmp_path, idle_timeout_s=1.5)
    tts = ToneTTS(chunks=30, chunk_s=0.2)  # 6 s of audio per sentence
    models = FakeModels(tts=tts)
    async with one_call(cfg, models) as (bridge, port, c):
        await c.say()
        await wait_for(lambda: c.media_in > 0, 10, "agent audio")
        c.stop_reading()
        tts.chunks = 1
        await a_good_call(port, cfg)  # served while the stalled call is still connected
        assert bridge.active_calls == 1
        data = await report_of(cfg, c.call_sid, timeout=40)
        assert data["end_reason"] == "idle_timeout", data["end_reason"]
        await wait_for(lambda: bridge.active_calls == 0 and not bridge.calls, 20, "the stalled call to close")
        c.ws.transport.abort()


# ---------------------------------------------------------------- faults on the agent's side


async def test_llm_raises_inside_a_turn_call_goes_on(tmp_path):
    cfg = rel_config(tmp_path)
    first = ScriptedBackend(["Sure, one moment. ", "x"], fail_after=1)
    models = FakeModels(backend=lambda: first)
    async with one_call(cfg, models) as (bridge, port, c):
        await c.say()
        assert await c.wait_reply()  # what was generated before the failure is spoken
        first.fail_after = None
        first.groups = ["We open at nine."]
        await answered_then_hung_up(c)  # the next turn is answered normally
        data = await report_of(cfg, c.call_sid)
        assert data["end_reason"] == "caller_hangup"
        t0, t1 = data["turns"]
        assert "RuntimeError: model exploded" in t0["error"] and t0["finish_reason"] == "error"
        assert t0["agent_text"] == "Sure, one moment. " and "error" not in t1
        assert "model exploded" in data["error"]
        await a_good_call(port, cfg)


async def test_stt_returns_nothing_no_llm_call(tmp_path):
    cfg = rel_config(tmp_path)
    models = FakeModels(stt=ScriptedSTT(""))
    async with one_call(cfg, models) as (bridge, port, c):
        await c.say()
        await wait_for(lambda: models.stt.calls == 1, 10, "STT")
        await c.say()
        await wait_for(lambda: models.stt.calls == 2, 10, "STT")
        await c.stop()
        await c.wait_closed()
        data = await report_of(cfg, c.call_sid)
        assert data["turns"] == [] and data["end_reason"] == "caller_hangup" and data["error"] is None
        assert c.media_in == 0 and models.backends[0].opened == 0  # no LLM call, no audio
        models.stt.text = "Hello?"
        await a_good_call(port, cfg)


async def test_stt_raises_turn_recorded_call_goes_on(tmp_path):
    cfg = rel_config(tmp_path)
    models = FakeModels(stt=ScriptedSTT(error=RuntimeError("whisper crashed")))
    async with one_call(cfg, models) as (bridge, port, c):
        await c.say()
        await wait_for(lambda: models.stt.calls == 1, 10, "STT")
        models.stt.error = None
        await answered_then_hung_up(c)
        data = await report_of(cfg, c.call_sid)
        t0, t1 = data["turns"]
        assert "whisper crashed" in t0["error"] and t1["agent_text"]


async def test_handler_crash_is_reported_and_bridge_survives(tmp_path, caplog):
    """A failure outside any turn (the call's own machinery) still writes the report."""
    cfg = rel_config(tmp_path)

    class BrokenEndpointer:
        in_speech = False

        def feed(self, pcm, t):
            raise ValueError("endpointer bug")

        def flush(self):
            return []

    models = FakeModels()
    good = models.new_endpointer
    models.new_endpointer = BrokenEndpointer
    async with one_call(cfg, models) as (bridge, port, c):
        with contextlib.suppress(ConnectionClosed):
            await c.say()
        data = await report_of(cfg, c.call_sid)
        assert data["end_reason"] == "error" and "endpointer bug" in data["error"]
        await c.wait_closed()
        models.new_endpointer = good
        await a_good_call(port, cfg)
    assert "endpointer bug" in caplog.text


async def test_mqtt_broker_dies_and_comes_back(tmp_path):
    from test_mqtt import MOSQUITTO, Broker, collect, free_port, not_events

    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed")
    broker = Broker(tmp_path, free_port())
    broker.start()
    cfg = rel_config(tmp_path)
    cfg = cfg.model_copy(update={"mqtt": cfg.mqtt.model_copy(update={
        "enabled": True, "port": broker.port, "topic_prefix": "svfault", "retry_s": 0.05})})
    models = FakeModels()
    try:
        async with one_call(cfg, models) as (bridge, port, c):
            topic = f"svfault/calls/{c.call_sid}/#"
            ready = asyncio.Event()
            # Turns and the summary; the live events topic (end of turn, ...) is not counted.
            sub = asyncio.create_task(collect("127.0.0.1", broker.port, topic, 1, timeout=20, identifier="svsub",
                                              clean_session=False, ready=ready, keep=not_events))
            await ready.wait()
            await c.say()
            assert await c.wait_reply()
            first = await sub
            broker.stop()  # the broker dies mid-call
            await c.say()
            assert await c.wait_reply()  # the call does not notice
            broker.start()  # ... and comes back
            await answered_then_hung_up(c)
            data = await report_of(cfg, c.call_sid)
            assert data["end_reason"] == "caller_hangup" and len(data["turns"]) == 3
            # Everything published after the outage reaches the subscriber's session.
            rest = await collect("127.0.0.1", broker.port, topic, 3, timeout=20, identifier="svsub",
                                 clean_session=False, keep=not_events)
            got = first + rest
            turns = sorted({json.loads(m.payload)["index"] for m in got if str(m.topic).endswith("/turns")})
            assert turns == [0, 1, 2], turns
            assert any(str(m.topic).endswith("/summary") for m in got)
            await a_good_call(port, cfg)
    finally:
        broker.stop()


# ---------------------------------------------------------------- missing model at start


def test_missing_model_at_start_is_a_clear_error(tmp_path, monkeypatch, capsys):
    from demo.cli import main
    from pipeline.agent import AgentModels
    from pipeline.config import load_config
    from modelstore import ModelNotFoundError

    monkeypatch.setenv("SPECVOICE_HOME", str(tmp_path / "empty-home"))
    monkeypatch.setenv("SPECVOICE_BRIDGE_TOKEN", "t0ken-for-this-test")
    with pytest.raises(ModelNotFoundError, match=r"is not in .*: run `specvoice models pull [\w.-]+`"):
        AgentModels.load(load_config("test"))
    # `specvoice serve` says which model and how to get it, in one line, no traceback.
    code = main(["serve", "--port", "0", "--config", "test"])
    err = capsys.readouterr().err
    assert code != 0
    assert "specvoice models pull" in err and "Traceback" not in err, err


def test_model_file_deleted_from_cache_is_a_clear_error(tmp_path, monkeypatch):
    """A pulled model whose weights file went missing: the error names the file."""
    import shutil

    from modelstore import is_present, model_dir
    from voice.stt import WhisperSTT

    if not is_present("whisper-tiny.en"):
        pytest.skip("whisper-tiny.en not pulled")
    home = tmp_path / "home"
    shutil.copytree(model_dir("whisper-tiny.en"), home / "models" / "whisper-tiny.en")
    monkeypatch.setenv("SPECVOICE_HOME", str(home))
    (home / "models" / "whisper-tiny.en" / "model.bin").unlink()
    from modelstore import resolve_model

    with pytest.raises(Exception) as info:
        WhisperSTT(resolve_model("whisper-tiny.en"))
    assert "model.bin" in str(info.value), str(info.value)


async def test_finished_calls_release_their_llm_state(tmp_path):
    """A long-running bridge must not keep every call's LLM conversation (its KV cache):
    once a call ended, its backend has let its state go; the handler lists a bounded number."""
    import gc

    from pipeline.transports.telephony.adapter import KEEP_CALLS

    cfg = rel_config(tmp_path)
    models = FakeModels()
    async with agent_bridge(cfg, models) as (bridge, port, handler):
        await a_good_call(port, cfg)
        await a_good_call(port, cfg)
        gc.collect()
        assert len(models.state_refs) == 2 and [r() for r in models.state_refs] == [None, None]
        assert len(handler.calls) == 2 and all(c.report_path for c in handler.calls)
        handler.calls.extend([handler.calls[0]] * (KEEP_CALLS + 5))
        c = await RawCaller(port).open()
        await c.stop()
        await c.wait_closed()
        assert len(handler.calls) == KEEP_CALLS
