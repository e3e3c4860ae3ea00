"""MQTT publishing against a real mosquitto broker started by the test."""

from __future__ import annotations

import asyncio
import getpass
import json
import logging
import shutil
import socket
import subprocess
import time
from pathlib import Path

import aiomqtt
import pytest

from callfakes import wait_for
from pipeline.mqtt import MqttPublisher, topic_segment

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
needs_broker = pytest.mark.skipif(MOSQUITTO is None, reason="mosquitto is not installed (apt-get install -y mosquitto)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broker:
    """A mosquitto on a loopback port, with persistence so sessions survive a restart."""

    def __init__(self, folder: Path, port: int) -> None:
        self.folder, self.port = folder, port
        self.proc: subprocess.Popen | None = None
        self.conf = folder / "mosquitto.conf"
        self.conf.write_text(
            f"listener {port} 127.0.0.1\nallow_anonymous true\n"
            f"persistence true\npersistence_location {folder}/\n"
            f"log_dest file {folder}/mosquitto.log\n"
            # Started as root, mosquitto would switch to user "mosquitto", which cannot
            # write its persistence file into the test's folder.
            f"user {getpass.getuser()}\n"
        )

    def start(self) -> None:
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited: {(self.folder / 'mosquitto.log').read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("mosquitto did not open its port")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: mosquitto saves its persistence file
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


@pytest.fixture
def broker(tmp_path):
    b = Broker(tmp_path, free_port())
    b.start()
    yield b
    b.stop()


async def collect(host: str, port: int, topic: str, want: int, *, timeout: float, identifier=None,
                  clean_session=None, ready: asyncio.Event | None = None, keep=None) -> list[aiomqtt.Message]:
    """The first `want` messages on `topic` (those `keep(message)` accepts, if given)."""
    got: list[aiomqtt.Message] = []
    async with aiomqtt.Client(host, port, identifier=identifier, clean_session=clean_session) as sub:
        await sub.subscribe(topic, qos=1)
        if ready is not None:
            ready.set()
        async with asyncio.timeout(timeout):
            async for msg in sub.messages:
                if keep is not None and not keep(msg):
                    continue
                got.append(msg)
                if len(got) >= want:
                    break
    return got


def not_events(message: aiomqtt.Message) -> bool:
    """Turns and summaries only: a call also publishes live events (end of turn, preemption)."""
    return not str(message.topic).endswith("/events")


def seqs(messages: list[aiomqtt.Message]) -> list[int]:
    return [json.loads(m.payload)["seq"] for m in messages if str(m.topic).endswith("/turns")]


@needs_broker
async def test_turns_and_summary_arrive_in_order(broker):
    ready = asyncio.Event()
    sub = asyncio.create_task(collect("127.0.0.1", broker.port, "sv/calls/+/#", 21, timeout=10, ready=ready))
    await ready.wait()
    pub = MqttPublisher("127.0.0.1", broker.port, topic_prefix="sv", retry_s=0.05)
    for i in range(20):
        pub.publish_turn("CA/1+#", {"seq": i, "metrics": {"ttft": 0.1 * i}})
    pub.publish_summary("CA/1+#", {"turns": 20})
    await pub.aclose(timeout=5)
    msgs = await sub
    assert seqs(msgs) == list(range(20))
    assert {str(m.topic) for m in msgs} == {"sv/calls/CA_1__/turns", "sv/calls/CA_1__/summary"}
    assert str(msgs[-1].topic).endswith("/summary") and json.loads(msgs[-1].payload)["turns"] == 20
    assert json.loads(msgs[0].payload)["call_id"] == "CA/1+#"
    assert pub.sent == 21 and pub.dropped == 0 and pub.lost == 0


@needs_broker
async def test_broker_outage_never_blocks_and_buffer_is_delivered(broker):
    topic, sub_id = "sv/calls/+/turns", "test-persistent-subscriber"
    # A persistent session: the broker keeps the subscription (and queued QoS 1 messages)
    # across its restart, so nothing the publisher flushes on reconnect can be missed.
    async with aiomqtt.Client("127.0.0.1", broker.port, identifier=sub_id, clean_session=False) as sub:
        await sub.subscribe(topic, qos=1)

    pub = MqttPublisher("127.0.0.1", broker.port, topic_prefix="sv", retry_s=0.05, max_retry_s=0.3,
                        publish_timeout_s=1.0)
    pub.start()
    for i in range(5):
        pub.publish_turn("call", {"seq": i})
    await wait_for(lambda: pub.sent == 5, 10, "the first five messages to be acknowledged")

    broker.stop()
    worst = 0.0
    for i in range(5, 40):
        t = time.perf_counter()
        pub.publish_turn("call", {"seq": i, "pad": "x" * 200})
        worst = max(worst, time.perf_counter() - t)
        assert pub.pending == i - 4  # queued, in order, nothing dropped
        await asyncio.sleep(0.01)  # the call keeps running meanwhile
    # publish must not wait for the network: waiting would mean the 1 s publish timeout (or
    # a connect attempt), so 0.25 s separates queueing from blocking on any machine.
    assert worst < 0.25, f"publish blocked for {worst * 1e3:.1f} ms"
    await wait_for(lambda: not pub.connected, 10, "the publisher to notice the outage")
    assert pub.sent == 5

    broker.start()
    msgs = await collect("127.0.0.1", broker.port, topic, 40, timeout=15, identifier=sub_id, clean_session=False)
    got = seqs(msgs)
    first_seen = list(dict.fromkeys(got))  # QoS 1 is at least once: a repeat is allowed
    assert first_seen == list(range(40))
    await pub.aclose(timeout=2)
    assert pub.dropped == 0 and pub.lost == 0


async def test_no_broker_lifecycle_is_quick_and_clean(caplog):
    caplog.set_level(logging.DEBUG, logger="specvoice.mqtt")
    pub = MqttPublisher("127.0.0.1", free_port(), retry_s=0.05, buffer=4)
    before = asyncio.all_tasks()
    async with pub:
        (sender,) = asyncio.all_tasks() - before  # the publisher's background task
        for i in range(10):
            pub.publish_turn("c1", {"seq": i})
        # A few failed connection attempts: the first is a warning, the next ones debug lines.
        await wait_for(lambda: sum("still unavailable" in r.getMessage() for r in caplog.records) >= 2, 10,
                       "failed connection attempts")
    assert pub.dropped == 6 and pub.sent == 0 and pub.lost == 4 and not pub.connected
    # Quick: closing did not wait for the missing broker until its timeout (2 s) and then
    # cancel the sender; the sender ended by itself, and nothing is left running.
    assert sender.done() and not sender.cancelled() and sender.exception() is None


async def test_close_is_bounded_even_when_sender_is_stuck():
    """A "broker" that accepts the connection and never answers: the sender is stuck in
    its connect for a minute. aclose(0.2) gives it 0.2 s, cancels it and waits at most
    0.5 s more; 5 s separates that bound from waiting for the stuck sender."""
    connected = asyncio.Event()
    peers = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer)
        connected.set()
        await reader.read()  # reads the CONNECT, never answers

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        pub = MqttPublisher("127.0.0.1", port, retry_s=0.05, connect_timeout_s=60)
        pub.publish("x/y", b"1")
        await asyncio.wait_for(connected.wait(), 10)
        t = time.perf_counter()
        await pub.aclose(timeout=0.2)
        assert time.perf_counter() - t < 5
        assert pub.lost == 1 and pub.sent == 0
    finally:
        for w in peers:
            w.close()
        server.close()
        await server.wait_closed()


async def test_publish_without_loop_start_and_disabled_config():
    from pipeline.config import MQTTConfig

    assert MqttPublisher.from_config(MQTTConfig()) is None
    pub = MqttPublisher.from_config(MQTTConfig(enabled=True, port=free_port(), buffer=8))
    assert pub is not None and pub.qos == 1
    for i in range(10):  # no broker there: the buffer of 8 keeps the newest
        pub.publish("a", str(i))
    assert pub.pending == 8 and pub.dropped == 2
    await pub.aclose(timeout=0.5)
    assert pub.lost == 8 and pub.pending == 0
    pub.publish("a", "b")  # after close: counted, not queued
    assert pub.pending == 0 and pub.dropped == 3


def test_topic_segment():
    assert topic_segment("a/b+c#d\x00e") == "a_b_c_d_e"
    assert topic_segment("") == "_"


# ---------------------------------------------------------------- live call events (issue 13)


@needs_broker
async def test_end_of_turn_and_preemptive_events_arrive_live_from_a_call(broker, tmp_path):
    """A real call (scripted caller, end-of-turn model, STT and LLM; the real endpointer,
    turn-taker and preemptor) publishing to a real mosquitto: the caller pauses (a
    preemptive start), speaks on (discarded), pauses again (a start) and stays silent until
    the maximum silence ends the turn (kept). The end-of-turn decision and the preemptive
    start / discarded / kept arrive on the call's events topic, before the turn's message,
    and say what the report says."""
    from callfakes import EnergyVAD, ScriptedBackend, ScriptedSTT, ToneTTS
    from pipeline.call import Call
    from pipeline.report import load_report
    from pipeline.stages.turn_taking import TurnTaker
    from test_preemptive import LengthModel, LogSink, ScriptSource, config, seconds_stt, silence, tone
    from voice.endpointer import EndpointConfig, Endpointer
    from voice.turn_detector import TurnPolicy

    got: list[aiomqtt.Message] = []
    ready = asyncio.Event()

    async def subscriber() -> None:
        async with aiomqtt.Client("127.0.0.1", broker.port) as sub:
            await sub.subscribe("sv/calls/+/#", qos=1)
            ready.set()
            async for msg in sub.messages:  # until the call's summary, the last message it sends
                got.append(msg)
                if str(msg.topic).endswith("/summary"):
                    return

    sub = asyncio.create_task(subscriber())
    await asyncio.wait_for(ready.wait(), 10)
    steps = [silence(0.3), tone(0.5), silence(0.4), tone(0.5), silence(0.4), silence(1.6)]
    endpointer = Endpointer(EnergyVAD(), EndpointConfig(min_speech_ms=64, min_silence_ms=200, pre_roll_ms=64,
                                                        post_roll_ms=32))
    turns = TurnTaker(LengthModel(None), TurnPolicy(check_silence_s=0.2, max_silence_s=1.5), clock=lambda: 0.0)
    local: list = []
    pub = MqttPublisher("127.0.0.1", broker.port, topic_prefix="sv", retry_s=0.05)
    call = Call(config(tmp_path), ScriptSource(steps), LogSink([]), stt=ScriptedSTT(seconds_stt),
                tts=ToneTTS(chunks=1, chunk_s=0.02), backend=ScriptedBackend(), endpointer=endpointer, turns=turns,
                mqtt=pub, call_id="call/live", on_event=lambda kind, data: local.append((kind, data)))
    await asyncio.wait_for(call.run(), 60)
    await asyncio.wait_for(sub, 15)

    assert {str(m.topic) for m in got} == {"sv/calls/call_live/events", "sv/calls/call_live/turns",
                                           "sv/calls/call_live/summary"}
    payloads = [(str(m.topic).rsplit("/", 1)[1], json.loads(m.payload)) for m in got]
    live = [p for topic, p in payloads if topic == "events"]
    assert [p["event"] for p in live] == ["preemptive_start", "preemptive_discarded", "preemptive_start",
                                          "end_of_turn", "preemptive_kept"]
    assert all(p["call_id"] == "call/live" and isinstance(p["t"], float) for p in live)
    # Live: every event came before the turn's own message (which comes once the turn is over).
    kinds = [topic for topic, _ in payloads]
    assert kinds == ["events"] * 5 + ["turns", "summary"]

    (turn,) = [p for topic, p in payloads if topic == "turns"]
    report = load_report(call.report_path)
    assert turn["end_of_turn"] == report["turns"][0]["end_of_turn"]
    start1, discarded, start2, eot, kept = live
    assert discarded["why"] == "caller_resumed"
    assert (start1["pause"], start2["pause"]) == (1, 2) and start2["audio_s"] > start1["audio_s"]
    assert kept["groups_ready"] >= 0
    # The decision with its probability and delay: the report's end_of_turn and eot_delay.
    e = report["turns"][0]["end_of_turn"]
    assert (eot["reason"], eot["probability"], eot["pauses"]) == (e["reason"], e["probability"], e["pauses"])
    assert eot["reason"] == "timeout" and eot["pauses"] == 2
    assert eot["delay"] == pytest.approx(report["turns"][0]["metrics"]["eot_delay"], abs=1e-5)
    # The same events, in the same order, as the report's preemptive log (less llm_start) and
    # as the call's local callback.
    logged = [ev["event"] for ev in report["turns"][0]["preemptive"]["events"] if ev["event"] != "llm_start"]
    assert [p["event"] for p in live if p["event"] != "end_of_turn"] == [f"preemptive_{x}" for x in logged]
    assert [(p["event"], {k: v for k, v in p.items() if k not in ("call_id", "event", "t")}) for p in live] == \
        [(k, d) for k, d in local if k.startswith("preemptive_") or k == "end_of_turn"]
    assert report["turns"][0]["preemptive_hit"] is True
    assert pub.sent == len(got) and pub.dropped == 0 and pub.lost == 0
