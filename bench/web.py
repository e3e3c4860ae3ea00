"""`specvoice bench web`: voice to voice through the call page vs the same lines through the
Twilio bridge, one server, side by side."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HELP = "voice to voice: the browser call page (real Chromium) vs the Twilio bridge, same lines"
DESCRIPTION = """\
One `specvoice serve` server (in-process, the config's models) takes two calls with the
same spoken lines (Piper's voice): one from the simulated Twilio caller (mu-law 8 kHz over
the Media Streams WebSocket, waiting for each answer), one from the call page in headless
Chromium whose microphone is a WAV of the lines, `--gap` seconds apart. For each line:

  server v2v   the call report's voice_to_voice (last voiced audio -> first agent audio
               out of the server): the same definition on both transports
  client v2v   what the far end saw: the Twilio caller from the end of its line to the
               first agent media frame received; the page from its last voiced microphone
               frame to the first agent sample out of its AudioWorklet player (audio clock)

  specvoice bench web --out bench/results/web-vs-twilio.json
  specvoice bench web --config test --lines 2 --gap 12
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="config name or TOML file (default: configs/default.toml)")
    parser.add_argument("--lines", type=int, default=3, help="how many of the default caller lines (default: 3)")
    parser.add_argument("--gap", type=float, default=20.0,
                        help="seconds between the page's lines: long enough for an answer (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--screenshot", type=Path, help="save a PNG of the page once every line was answered")


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def run(args: argparse.Namespace) -> int:
    import asyncio

    from bench import write_json
    from bench.chromium import CHROMIUM
    from demo.commands import load_config_or_exit

    if CHROMIUM is None:
        print("specvoice bench web: needs chromium (apt-get install chromium)", file=sys.stderr)
        return 2
    config = load_config_or_exit(args.config, "specvoice bench web")
    result = asyncio.run(_bench(config, args))
    _print(result)
    if args.out:
        write_json(args.out, result)
    return 0


async def _bench(config, args) -> dict:
    import secrets
    import tempfile

    from bench import report_header
    from demo.caller import DEFAULT_SCRIPT, SimulatedCaller, prepare_lines
    from pipeline.agent import AgentModels
    from pipeline.transports.telephony.auth import BridgeTokens
    from pipeline.transports.web.agent_server import agent_server

    script = DEFAULT_SCRIPT[: max(1, args.lines)]
    reports = Path(tempfile.mkdtemp(prefix="specvoice-bench-web-"))
    config = config.model_copy(update={
        "report": config.report.model_copy(update={"dir": str(reports)}),
        "bridge": config.bridge.model_copy(update={"host": "127.0.0.1", "port": 0, "idle_timeout_s": 120.0}),
        "mqtt": config.mqtt.model_copy(update={"enabled": False}),
    })
    print("loading models...", file=sys.stderr, flush=True)
    models = AgentModels.load(config)
    token = secrets.token_urlsafe(24)
    server = agent_server(config, BridgeTokens.of(bearer_token=token), models=models, greeting=False)
    port = await server.start()
    try:
        print("Twilio bridge call...", file=sys.stderr, flush=True)
        lines = prepare_lines(script, models.tts)
        caller = await SimulatedCaller(f"ws://127.0.0.1:{port}/media-stream", lines, token=token,
                                       expect_greeting=False).run()
        twilio_call = server.on_call.calls[-1]
        print("call page in Chromium...", file=sys.stderr, flush=True)
        page_v2v, browser_call = await _page_call(models, script, port, args.gap, reports, server, args.screenshot)
    finally:
        await server.stop()

    def server_v2v(call) -> list[float | None]:
        return [t["metrics"].get("voice_to_voice") for t in call.report.turns]

    twilio = {"server_v2v": server_v2v(twilio_call), "client_v2v": [t.voice_to_voice for t in caller.turns],
              "interrupted": [t["interrupted"] for t in twilio_call.report.turns],
              "transcripts": [t["user_text"] for t in twilio_call.report.turns]}
    page = {"server_v2v": server_v2v(browser_call), "client_v2v": page_v2v,
            "interrupted": [t["interrupted"] for t in browser_call.report.turns],
            "transcripts": [t["user_text"] for t in browser_call.report.turns]}
    for side in (twilio, page):
        side["server_v2v_p50"] = _median([v for v in side["server_v2v"] if v is not None])
        side["client_v2v_p50"] = _median([v for v in side["client_v2v"] if v is not None])
    return {**report_header("web", config.llm), "lines": [s["text"] for s in script], "gap_s": args.gap,
            "stt": config.stt.model, "twilio": twilio, "page": page}


async def _page_call(models, script, port: int, gap_s: float, folder: Path, server, screenshot: Path | None):
    import numpy as np

    from bench.chromium import chromium, open_page
    from demo.caller import trim_silence
    from voice.audio import resample, to_float32
    from voice.wav import write_wav

    pieces = [np.zeros(16000 * 2, np.float32)]
    for item in script:
        chunks = list(models.tts.synthesize(item["text"]))
        pcm = resample(np.concatenate([to_float32(c.pcm) for c in chunks]), chunks[0].sample_rate, 16000)
        pieces += [trim_silence(pcm, 16000), np.zeros(int(16000 * gap_s), np.float32)]
    wav = write_wav(folder / "page-microphone.wav", np.concatenate(pieces), 16000)
    n = len(script)
    async with (chromium(wav, window=(1100, 1300)) as devtools,
                open_page(devtools, f"http://127.0.0.1:{port}/", read_timeout_s=None) as page):
        await page.click("#call")
        await page.until("window.specvoice.state === 'in-call'")
        # Every line answered and its turn recorded (the turn's figures reach the page at its end).
        await page.until(f"document.querySelectorAll('#turns .turn[data-final=\"1\"]').length >= {n}",
                         timeout_s=60 + n * (gap_s + 60))
        v2v = await page.evaluate("JSON.stringify(window.specvoice.pageV2V)")
        if screenshot is not None:
            import base64

            shot = await page.call("Page.captureScreenshot", format="png")
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            screenshot.write_bytes(base64.b64decode(shot["data"]))
        await page.click("#hangup")
        await page.until("window.specvoice.state === 'ended'")
    browser_call = server.on_browser_call.calls[-1]
    return json.loads(v2v), browser_call


def _ms(value) -> str:
    return "    -" if value is None else f"{value * 1000:5.0f}"


def _print(result: dict) -> None:
    print(f"\nvoice to voice, ms (STT {result['stt']}, LLM {result['models']['target']}):")
    print(" line | Twilio server | Twilio caller | page server | page (browser) | text")
    t, p = result["twilio"], result["page"]
    for i, text in enumerate(result["lines"]):
        cells = [side[key][i] if i < len(side[key]) else None for side in (t, p) for key in ("server_v2v", "client_v2v")]
        print(f" {i:4d} |         {_ms(cells[0])} |         {_ms(cells[1])} |       {_ms(cells[2])} |"
              f"          {_ms(cells[3])} | {text[:40]}")
    print(f"  p50 |         {_ms(t['server_v2v_p50'])} |         {_ms(t['client_v2v_p50'])} |"
          f"       {_ms(p['server_v2v_p50'])} |          {_ms(p['client_v2v_p50'])} |")
    for name, side in (("Twilio", t), ("page", p)):
        if any(side["interrupted"]):
            print(f"  ({name}: a turn was interrupted; its figure is not comparable)")
        print(f"  {name} heard: {side['transcripts']}")
