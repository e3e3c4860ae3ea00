"""`specvoice mic`: talk to the agent through the microphone and speakers."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator

HELP = "live demo: talk to the agent with your microphone and speakers"
DESCRIPTION = """\
Talk to the agent through the default microphone and speakers. Shows your transcript,
the agent's text as token groups arrive, and each turn's latency.

Half-duplex by default: the microphone is muted while the agent speaks, so it does not
hear itself through the speakers. With headphones, --barge-in lets you interrupt it.

  specvoice mic
  specvoice mic --barge-in --config gpu

Needs PortAudio and a sound device; without them (servers, containers) it exits with
a message: use `specvoice call` there, which simulates the caller.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="config name or TOML file (default: configs/default.toml)")
    parser.add_argument("--barge-in", action="store_true", help="full duplex: speak over the agent to interrupt it")
    parser.add_argument("--input-device", help="PortAudio input device (index or name)")
    parser.add_argument("--output-device", help="PortAudio output device (index or name)")
    parser.add_argument("--no-greeting", action="store_true", help="the agent does not greet first")


class MicSource:
    """Microphone frames; muted (zeros) while `muted()` says so (half-duplex)."""

    hangup = True

    def __init__(self, device=None, muted=None):
        self.device = device
        self.muted = muted or (lambda: False)

    def __aiter__(self) -> AsyncIterator:
        return self._frames()

    async def _frames(self):
        import numpy as np

        from pipeline.io import AudioFrame
        from voice.devices import microphone

        async for frame in microphone(device=self.device):
            pcm = np.zeros_like(frame.pcm) if self.muted() else frame.pcm
            yield AudioFrame(pcm, frame.t)


class SpeakerSink:
    """voice.devices.Speaker as an AudioSink: marks resolve when the audio before them has
    played by the speaker's clock; clear drops queued audio."""

    def __init__(self, speaker):
        self.speaker = speaker
        self.on_audio_out = None
        self._play_end = 0.0
        self._marks: dict[str, asyncio.Future] = {}
        self._timers: list[asyncio.TimerHandle] = []

    async def play(self, chunk) -> None:
        from voice.audio import resample

        pcm = chunk.pcm if chunk.sample_rate == self.speaker.sample_rate else \
            resample(chunk.pcm, chunk.sample_rate, self.speaker.sample_rate)
        now = time.monotonic()
        self._play_end = max(self._play_end, now) + len(pcm) / self.speaker.sample_rate
        self.speaker.play(pcm)
        if self.on_audio_out is not None:
            self.on_audio_out(now)

    async def mark(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._marks[name] = future
        delay = max(0.0, self._play_end - time.monotonic())
        self._timers.append(loop.call_later(delay, lambda: future.done() or future.set_result(True)))

    async def wait_mark(self, name: str, timeout: float | None = None) -> bool:
        from pipeline.io import wait_for_mark

        return await wait_for_mark(self._marks.get(name), timeout)

    async def clear(self) -> None:
        self.speaker.clear()
        self._play_end = 0.0
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        for future in self._marks.values():
            if not future.done():
                future.set_result(False)

    @property
    def speaking(self) -> bool:
        return self._play_end > time.monotonic()

    async def aclose(self) -> None:
        await self.clear()


def run(args: argparse.Namespace) -> int:
    from voice.devices import check_device
    from voice.errors import DeviceUnavailableError

    try:
        check_device("input", args.input_device)
        check_device("output", args.output_device)
    except DeviceUnavailableError as exc:
        print(f"specvoice mic: {exc}", file=sys.stderr)
        return 1

    from pipeline.agent import AgentModels
    from pipeline.config import ConfigError, load_config
    from pipeline.models import ModelNotFoundError

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"specvoice mic: {exc}", file=sys.stderr)
        return 2
    config = config.model_copy(update={"pipeline": config.pipeline.model_copy(update={"barge_in": args.barge_in})})
    try:
        print("loading models...", file=sys.stderr, flush=True)
        models = AgentModels.load(config)
    except (ModelNotFoundError, OSError, RuntimeError, ValueError) as exc:
        print(f"specvoice mic: {exc}", file=sys.stderr)
        return 1

    from demo.commands.call import HEADER, server_row
    from pipeline.call import Call
    from voice.devices import Speaker

    def on_event(kind: str, data: dict) -> None:
        if kind == "transcript":
            print(f"\nyou: {data['text']}\nagent: ", end="", flush=True)
        elif kind == "llm_text":
            print(data["text"], end="", flush=True)
        elif kind == "barge_in":
            print(" [interrupted]", flush=True)

    def on_turn(entry: dict) -> None:
        print("\n" + HEADER.splitlines()[0] + "\n" + server_row(entry), flush=True)

    async def main() -> None:
        with Speaker(models.tts.sample_rate, device=args.output_device) as speaker:
            sink = SpeakerSink(speaker)
            muted = (lambda: False) if args.barge_in else (lambda: sink.speaking)
            source = MicSource(args.input_device, muted)
            call = Call(config, models, source, sink, greeting=not args.no_greeting, on_turn=on_turn,
                        on_event=on_event)
            print("listening: speak to the agent (Ctrl-C to hang up)", flush=True)
            try:
                await call.run()
            finally:
                if call.report_path:
                    print(f"\nreport: {call.report_path}\nrender it: specvoice report {call.report_path}")

    try:
        asyncio.run(main())
    except DeviceUnavailableError as exc:
        print(f"specvoice mic: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0
