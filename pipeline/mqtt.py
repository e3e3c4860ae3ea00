"""Publish per-turn metrics and call summaries to an MQTT broker, without ever slowing a call.

A call must not wait on telemetry. `publish()` only appends to a bounded in-memory queue
(dropping the oldest message when full, and counting the drops); one background task owns
the broker connection, sends messages in order, reconnects with exponential backoff when
the broker is down or drops the connection, and keeps a message at the head of the queue
until the broker has acknowledged it (QoS 1: at least once, so a reconnect may repeat the
one message that was in flight). `aclose(timeout)` flushes what it can within the timeout
and always returns.

Topics: `<prefix>/calls/<call_id>/turns` (one JSON message per finished turn),
`<prefix>/calls/<call_id>/events` (live turn-taking events as they happen: the end-of-turn
decision and preemptive start / kept / discarded; {"call_id", "event", "t", ...}) and
`<prefix>/calls/<call_id>/summary` (one at the end of the call).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiomqtt

from pipeline.events import MQTT_KINDS, CallEvent, TurnRecorded

__all__ = ["CallTelemetry", "MqttPublisher", "topic_segment"]

log = logging.getLogger("specvoice.mqtt")

# MQTT topic levels must not contain the separators or wildcards; NUL is forbidden outright.
_TOPIC_UNSAFE = re.compile(r"[/+#\x00-\x1f\x7f]")


def topic_segment(value: str) -> str:
    """One safe topic level from an arbitrary id (a call id comes from outside)."""
    return _TOPIC_UNSAFE.sub("_", value) or "_"


@dataclass(frozen=True)
class _Message:
    topic: str
    payload: bytes


class MqttPublisher:
    """Fire-and-forget MQTT publishing for the pipeline. Use within one asyncio loop."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 1883,
        *,
        topic_prefix: str = "specvoice",
        qos: int = 1,
        buffer: int = 256,
        retry_s: float = 1.0,
        max_retry_s: float = 30.0,
        publish_timeout_s: float = 3.0,
        connect_timeout_s: float = 5.0,
        client_id: str | None = None,
    ) -> None:
        if buffer < 1:
            raise ValueError("buffer must be >= 1")
        self.host, self.port = host, port
        self.topic_prefix = topic_prefix.rstrip("/")
        self.qos = qos
        self.retry_s, self.max_retry_s = retry_s, max(retry_s, max_retry_s)
        self.publish_timeout_s = publish_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.client_id = client_id or f"specvoice-{uuid.uuid4().hex[:12]}"
        self._queue: collections.deque[_Message] = collections.deque()
        self._capacity = buffer
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.sent = 0  # messages the broker acknowledged
        self.dropped = 0  # messages dropped because the queue was full
        self.lost = 0  # messages still queued when the publisher closed
        self.connected = False

    @classmethod
    def from_config(cls, cfg: Any, **kwargs: Any) -> "MqttPublisher | None":
        """A publisher for a `MQTTConfig` section, or None when MQTT is disabled."""
        if not cfg.enabled:
            return None
        return cls(cfg.host, cfg.port, topic_prefix=cfg.topic_prefix, qos=cfg.qos,
                   buffer=cfg.buffer, retry_s=cfg.retry_s, **kwargs)

    # -- topics -------------------------------------------------------------------------

    def turns_topic(self, call_id: str) -> str:
        return f"{self.topic_prefix}/calls/{topic_segment(call_id)}/turns"

    def events_topic(self, call_id: str) -> str:
        return f"{self.topic_prefix}/calls/{topic_segment(call_id)}/events"

    def summary_topic(self, call_id: str) -> str:
        return f"{self.topic_prefix}/calls/{topic_segment(call_id)}/summary"

    # -- the non-blocking side ----------------------------------------------------------

    @property
    def pending(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        """Start the background sender (idempotent; `publish` starts it too)."""
        if self._task is not None or self._closing:
            return
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"mqtt-{self.client_id}")

    def publish(self, topic: str, payload: dict[str, Any] | str | bytes) -> None:
        """Queue a message and return at once. Oldest messages are dropped when full."""
        if self._closing:
            log.debug("mqtt: publisher closed; dropping message for %s", topic)
            self.dropped += 1
            return
        if isinstance(payload, dict):
            payload = json.dumps(payload, separators=(",", ":"), default=str)
        if isinstance(payload, str):
            payload = payload.encode("utf-8")
        if len(self._queue) >= self._capacity:
            self._queue.popleft()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                log.warning("mqtt: queue full (%d); dropped %d message(s) so far", self._capacity, self.dropped)
        self._queue.append(_Message(topic, payload))
        try:
            self.start()
        except RuntimeError:  # no running loop: keep it queued until start()
            return
        assert self._wakeup is not None
        self._wakeup.set()

    def publish_turn(self, call_id: str, turn: dict[str, Any]) -> None:
        self.publish(self.turns_topic(call_id), {"call_id": call_id, **turn})

    def publish_event(self, call_id: str, event: str, data: dict[str, Any]) -> None:
        self.publish(self.events_topic(call_id), {"call_id": call_id, "event": event, **data})

    def publish_summary(self, call_id: str, summary: dict[str, Any]) -> None:
        self.publish(self.summary_topic(call_id), {"call_id": call_id, **summary})

    # -- closing ------------------------------------------------------------------------

    async def aclose(self, timeout: float = 2.0) -> None:
        """Flush what can be sent within `timeout` seconds, then stop. Never hangs."""
        self._closing = True
        task = self._task
        if task is not None and not task.done():
            assert self._wakeup is not None
            self._wakeup.set()
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if not done:
                task.cancel()
                # aiomqtt's disconnect may itself wait; give it a moment, then abandon it.
                await asyncio.wait({task}, timeout=0.5)
        if task is not None and task.done() and not task.cancelled() and task.exception():
            log.error("mqtt: sender failed: %r", task.exception())
        self.lost = len(self._queue)
        if self.lost:
            log.warning("mqtt: closed with %d unsent message(s) (broker %s:%d)", self.lost, self.host, self.port)
        self._queue.clear()

    async def __aenter__(self) -> "MqttPublisher":
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- the background sender ----------------------------------------------------------

    async def _run(self) -> None:
        backoff = self.retry_s
        outage_logged = False
        while True:
            if self._closing and not self._queue:
                return
            try:
                async with aiomqtt.Client(
                    self.host, self.port, identifier=self.client_id, timeout=self.connect_timeout_s
                ) as client:
                    self.connected = True
                    if outage_logged:
                        log.info("mqtt: reconnected to %s:%d", self.host, self.port)
                    outage_logged, backoff = False, self.retry_s
                    await self._drain(client)
                    return  # drained while closing
            except (aiomqtt.MqttError, OSError) as exc:
                if not outage_logged:
                    log.warning("mqtt: broker %s:%d unavailable (%s); retrying, %d queued",
                                self.host, self.port, exc, len(self._queue))
                    outage_logged = True
                else:
                    log.debug("mqtt: still unavailable: %s", exc)
            except Exception:  # a bug or a surprise from the client library: keep going
                log.exception("mqtt: unexpected error in the sender; retrying")
            finally:
                self.connected = False
            if self._closing:
                return  # the broker is gone and we are closing: do not wait for it
            await self._sleep(backoff)
            backoff = min(backoff * 2, self.max_retry_s)

    async def _drain(self, client: aiomqtt.Client) -> None:
        assert self._wakeup is not None
        lost = _connection_lost(client)
        while True:
            while self._queue:
                msg = self._queue[0]
                await _unless_lost(
                    client.publish(msg.topic, msg.payload, qos=self.qos, timeout=self.publish_timeout_s), lost
                )
                self.sent += 1
                # publish() may have dropped this message as the oldest while we awaited.
                if self._queue and self._queue[0] is msg:
                    self._queue.popleft()
            if self._closing:
                return
            self._wakeup.clear()  # no await since the emptiness check: no lost wake-up
            # Idle: also watch the connection, so `connected` is true and a reconnect starts
            # before the next message rather than after its publish times out.
            await _unless_lost(self._wakeup.wait(), lost)

    async def _sleep(self, seconds: float) -> None:
        """Back off, but wake early when closing so aclose gets one more attempt."""
        assert self._wakeup is not None
        self._wakeup.clear()
        try:
            await asyncio.wait_for(self._wait_closing(), timeout=seconds)
        except asyncio.TimeoutError:
            pass

    async def _wait_closing(self) -> None:
        assert self._wakeup is not None
        while not self._closing:
            await self._wakeup.wait()
            self._wakeup.clear()


class CallTelemetry:
    """One call's observer on MQTT: each finished turn to the turns topic, the live events
    (MQTT_KINDS) to the events topic as they happen, the summary once the call is over.
    `t` on an event is seconds since the call start (`t0`, monotonic), like the report's
    timelines."""

    def __init__(self, publisher: MqttPublisher, call_id: str, t0: float):
        self.publisher, self.call_id, self.t0 = publisher, call_id, t0

    def __call__(self, event: CallEvent) -> None:
        if isinstance(event, TurnRecorded):
            self.publisher.publish_turn(self.call_id, event.entry)
        elif event.kind in MQTT_KINDS:
            t = round(time.monotonic() - self.t0, 6)
            self.publisher.publish_event(self.call_id, event.kind, {"t": t, **event.as_dict()})

    async def close(self, end_reason: str | None, error: str | None, summary: dict[str, Any]) -> None:
        """The call's summary, then the link closed (within two seconds, whatever the broker does)."""
        self.publisher.publish_summary(self.call_id, {"end_reason": end_reason, "error": error, **summary})
        with contextlib.suppress(BaseException):
            await self.publisher.aclose(timeout=2.0)


def _connection_lost(client: aiomqtt.Client) -> asyncio.Future[Any] | None:
    """The client's 'disconnected' future, if this aiomqtt version has one.

    aiomqtt resolves it (with an error when unexpected) the moment the socket closes, but
    a QoS 1 publish in flight would only notice at its timeout. Watching it lets the sender
    reconnect at once; it is a private attribute, so its absence only costs that speed.
    """
    fut = getattr(client, "_disconnected", None)
    return fut if isinstance(fut, asyncio.Future) else None


async def _unless_lost(awaitable: Any, lost: asyncio.Future[Any] | None) -> Any:
    """Await `awaitable`, or raise MqttError as soon as the connection is lost."""
    if lost is None:
        return await awaitable
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    reason = None if lost.cancelled() else lost.exception()  # also marks it retrieved
    raise aiomqtt.MqttError(f"connection lost: {reason or 'disconnected'}")
