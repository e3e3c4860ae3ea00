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
                  clean_session=None, ready: asyncio.Event | None = None) -> list[aiomqtt.Message]:
    got: list[aiomqtt.Message] = []
    async with aiomqtt.Client(host, port, identifier=identifier, clean_session=clean_session) as sub:
        await sub.subscribe(topic, qos=1)
        if ready is not None:
            ready.set()
        async with asyncio.timeout(timeout):
            async for msg in sub.messages:
                got.append(msg)
                if len(got) >= want:
                    break
    return got


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
