"""Prometheus metrics of the server (`/metrics`, text format, prometheus-client).

Calls in progress, calls started and refused, turns, and per-turn histograms of the
figures the call reports already compute (pipeline/report.py: one definition): voice to
voice, first sentence, TTFT, STT, and the LLM's tokens per target pass and tokens/s.
Turns are observed from the report entry each finished turn produces (the one MQTT
publishes), so /metrics and the reports can never disagree.

Each server has its own registry: several servers in one process (the tests) do not
share counters.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds: a turn's silence on a CPU runs from a few hundred ms to several seconds.
LATENCY_BUCKETS = (0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 20.0)
STAGE_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
TOKENS_PER_PASS_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 9.0)
TOKENS_PER_S_BUCKETS = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 50.0, 100.0, 200.0, 500.0)

# Histogram name -> (the report entry's metric, help).
TURN_HISTOGRAMS = {
    "voice_to_voice": ("voice_to_voice", "last voiced audio of the caller to first agent audio out"),
    "first_sentence": ("first_sentence_latency", "LLM request to the first complete sentence handed to TTS"),
    "ttft": ("ttft", "LLM request to the first token"),
    "stt": ("stt_latency", "end of speech declared to the final transcript"),
}


class ServerMetrics:
    def __init__(self, calls_in_progress: Callable[[], int]):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        Gauge("specvoice_calls_in_progress", "calls (phone and browser) being served now",
              registry=r).set_function(calls_in_progress)
        self.calls = Counter("specvoice_calls", "calls started", ["transport"], registry=r)
        self.refusals = Counter("specvoice_calls_refused", "calls refused (max_calls reached, or draining)",
                                ["reason"], registry=r)
        self.turns = Counter("specvoice_turns", "turns answered (greetings not counted)", ["transport"], registry=r)
        self.latency = {
            name: Histogram(f"specvoice_{name}_seconds", text, registry=r,
                            buckets=LATENCY_BUCKETS if name in ("voice_to_voice", "first_sentence") else STAGE_BUCKETS)
            for name, (_, text) in TURN_HISTOGRAMS.items()
        }
        self.tokens_per_pass = Histogram("specvoice_llm_tokens_per_pass", "tokens accepted per target pass, per turn",
                                         registry=r, buckets=TOKENS_PER_PASS_BUCKETS)
        self.tokens_per_s = Histogram("specvoice_llm_tokens_per_second", "LLM decoding speed, per turn",
                                      registry=r, buckets=TOKENS_PER_S_BUCKETS)
        # Every label value shows from the start (a rate() over a series that appears late misses its first step).
        for transport in ("twilio", "browser"):
            self.calls.labels(transport)
            self.turns.labels(transport)
        for reason in ("busy", "draining"):
            self.refusals.labels(reason)

    def call_started(self, transport: str) -> None:
        self.calls.labels(transport).inc()

    def refused(self, reason: str) -> None:
        self.refusals.labels(reason).inc()

    def observe_turn(self, entry: dict[str, Any], transport: str = "twilio") -> None:
        """A finished turn's report entry (pipeline.report.CallReport.add_turn)."""
        self.turns.labels(transport).inc()
        figures = entry.get("metrics") or {}
        for name, (key, _) in TURN_HISTOGRAMS.items():
            value = _number(figures.get(key))
            if value is not None:
                self.latency[name].observe(value)
        llm = entry.get("llm") or {}
        if (tpp := _number(llm.get("tokens_per_pass"))) is not None and llm.get("passes"):
            self.tokens_per_pass.observe(tpp)
        if (tps := _number(llm.get("tokens_per_s"))) is not None and llm.get("new_tokens"):
            self.tokens_per_s.observe(tps)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if value == value and value not in (float("inf"), float("-inf")) else None
