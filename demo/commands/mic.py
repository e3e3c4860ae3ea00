"""`specvoice mic`: talk to the agent through the microphone and speakers."""

from __future__ import annotations

import argparse
import asyncio
import sys

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


def run(args: argparse.Namespace) -> int:
    from voice.devices import check_device
    from voice.errors import DeviceUnavailableError

    try:
        check_device("input", args.input_device)
        check_device("output", args.output_device)
    except DeviceUnavailableError as exc:
        print(f"specvoice mic: {exc}", file=sys.stderr)
        return 1

    from demo.commands import load_config_or_exit, load_models_or_exit

    config = load_config_or_exit(args.config, "specvoice mic")
    config = config.model_copy(update={"pipeline": config.pipeline.model_copy(update={"barge_in": args.barge_in})})
    models = load_models_or_exit(config, "specvoice mic")

    from demo.commands.call import HEADER, server_row
    from pipeline.call import Call
    from pipeline.transports.local_audio import MicSource, speaker_sink
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
            sink = speaker_sink(speaker)
            muted = (lambda: False) if args.barge_in else (lambda: sink.busy)
            source = MicSource(args.input_device, muted)
            call = Call.from_models(config, models, source, sink, greeting=not args.no_greeting, on_turn=on_turn,
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
