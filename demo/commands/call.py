"""`specvoice call`: a simulated phone call against the agent, with a live latency table."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HELP = "simulated phone call: the offline end-to-end demo, with per-turn latency"
DESCRIPTION = """\
Place a simulated phone call. The caller dials the telephony bridge exactly as Twilio
would (WebSocket, mu-law 8 kHz, 20 ms media paced in real time, marks echoed once
played, `clear` honoured) and speaks a script: a few receptionist questions spoken by
Piper by default. It waits for the agent to finish before the next line, can barge in,
prints a latency table as the call runs, records both sides to a stereo WAV and writes
the call's report.

With no --bridge it starts the bridge and the agent in-process (loading the models of
--config; a bearer token is made up for the call), so this alone is the offline demo:

  specvoice call
  specvoice call --script my-call.json --out-wav call.wav
  specvoice call --bridge ws://127.0.0.1:8765/media-stream --token "$SPECVOICE_BRIDGE_TOKEN"

A script is a JSON list (or TOML [[line]] tables) of lines: "text to say", or
{"text": ...} / {"wav": "file.wav"}, optionally with "barge_in_after_s": speak this
line that many seconds after the agent's previous answer started, over it.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--script", type=Path, help="JSON/TOML list of lines (default: three receptionist questions)")
    parser.add_argument("--bridge", help="ws(s)://host:port/media-stream of a running bridge (default: start one here)")
    parser.add_argument("--token", help="bearer token for --bridge (default: $SPECVOICE_BRIDGE_TOKEN)")
    parser.add_argument("--config", help="config name or TOML file (default: configs/default.toml)")
    parser.add_argument("--out-wav", type=Path, help="stereo recording: caller left, agent right (default: next to the report)")
    parser.add_argument("--report-dir", type=Path, help="where the call report goes (default: report.dir)")
    parser.add_argument("--no-greeting", action="store_true", help="the agent does not greet; the caller speaks first")
    parser.add_argument("--silence", type=float, default=1.2, metavar="S",
                        help="agent silence that ends its turn, from the caller's side (default: %(default)s)")


def _ms(x) -> str:
    return "    -" if x is None else f"{x * 1000:5.0f}"


# eot: end of the caller's voiced speech -> turn end decided (silence wait or Smart Turn);
# pre: the turn's preemptive generation was kept ("hit"), started but dropped ("miss"), or
# never started ("-"); see pipeline/stages/preempt.py. stt: transcription after the end of
# the turn (stt_after_endpoint; with stt.streaming only the words not yet stable).
HEADER = (" turn |   eot | pre  |   stt |  ttft | 1st sent |   tts |   v2v | tok/pass | user -> agent\n"
          "------+-------+------+-------+-------+----------+-------+-------+----------+--------------")


def _preemptive(entry: dict) -> str:
    hit = entry.get("preemptive_hit")
    return " -  " if hit is None else ("hit " if hit else "miss")


def server_row(entry: dict) -> str:
    m = entry["metrics"]
    llm = entry.get("llm") or {}
    agent = entry.get("agent_text_heard") if entry.get("interrupted") else entry.get("agent_text")
    flag = " [barge-in]" if entry.get("interrupted") else ""
    if entry.get("error"):
        flag += f" [error: {entry['error']}]"
    text = f"{entry['user_text'][:40]!r} -> {(agent or '')[:60]!r}{flag}"
    tpp = llm.get("tokens_per_pass")
    eot = m.get("eot_delay", m.get("endpoint_delay"))
    return (f" {entry['index']:4d} | {_ms(eot)} | {_preemptive(entry)} | {_ms(m.get('stt_after_endpoint', m.get('stt_latency')))} | "
            f"{_ms(m.get('ttft'))} | {_ms(m.get('first_sentence_latency'))}    | {_ms(m.get('tts_first_audio'))} | "
            f"{_ms(m.get('voice_to_voice'))} | {'    -' if tpp is None else f'{tpp:8.2f}'} | {text}")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from demo.commands import load_config_or_exit

    config = load_config_or_exit(args.config, "specvoice call")
    from demo.caller import DEFAULT_SCRIPT, load_script, prepare_lines

    try:
        script = load_script(args.script) if args.script else DEFAULT_SCRIPT
    except (OSError, ValueError) as exc:
        print(f"specvoice call: bad script: {exc}", file=sys.stderr)
        return 2
    report_dir = args.report_dir or Path(config.report.dir)

    from modelstore import ModelNotFoundError

    models = None
    try:
        if args.bridge:
            tts = _caller_tts(config)
        else:
            from pipeline.agent import AgentModels

            print("loading models (LLM, Whisper, Piper, Silero)...", file=sys.stderr, flush=True)
            models = AgentModels.load(config)
            loaded = ", ".join(f"{k} {v:.1f}s" for k, v in models.load_s.items())
            print(f"loaded: {loaded}", file=sys.stderr)
            tts = models.tts
        lines = prepare_lines(script, tts)
    except (ModelNotFoundError, OSError, ValueError, RuntimeError) as exc:
        print(f"specvoice call: {exc}", file=sys.stderr)
        return 1

    def on_server_turn(call_id: str, entry: dict) -> None:
        print(server_row(entry), flush=True)

    def on_caller_turn(turn) -> None:
        if args.bridge:
            v = turn.voice_to_voice
            print(f" {turn.index:4d} | caller-side v2v {_ms(v)} ms | agent audio {turn.agent_audio_s:5.1f} s | "
                  f"{turn.label[:60]!r}", flush=True)

    async def main():
        if args.bridge:
            from demo.caller import SimulatedCaller

            token = args.token or os.environ.get("SPECVOICE_BRIDGE_TOKEN")
            caller = SimulatedCaller(args.bridge, lines, token=token, expect_greeting=not args.no_greeting,
                                     silence_s=args.silence, on_turn=on_caller_turn)
            return await caller.run(), None
        from demo.caller import call_in_process

        return await call_in_process(config, lines, models=models, report_dir=report_dir,
                                     greeting=not args.no_greeting, on_server_turn=on_server_turn,
                                     on_caller_turn=on_caller_turn, silence_s=args.silence)

    print(HEADER if not args.bridge else "caller-side view of the call (server metrics are in its report):")
    try:
        result, call = asyncio.run(main())
    except OSError as exc:
        print(f"specvoice call: cannot reach the bridge: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # websockets InvalidStatus (401/403/503) and friends
        print(f"specvoice call: the call failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1

    print("\ncaller side (end of the caller's line -> first agent audio received):")
    for t in result.turns:
        print(f"  line {t.index}: v2v {_ms(t.voice_to_voice).strip()} ms, agent audio {t.agent_audio_s:.1f} s"
              f"{'  (spoken over the agent)' if t.barged_in else ''}  {t.label[:60]!r}")
    print(f"  media in {result.media_in}, marks {len(result.marks_received)} sent / {len(result.marks_echoed)} echoed, "
          f"clears {len(result.clears)}")
    wav = args.out_wav
    report_path = getattr(call, "report_path", None) if call is not None else None
    if wav is None:
        wav = (report_path.with_suffix(".wav") if report_path else Path(report_dir) / f"{result.call_sid}.wav")
    result.write_wav(wav)
    print(f"recording (caller left, agent right): {wav}")
    if report_path:
        s = call.report.to_dict()["summary"]
        v2v = s["metrics"]["voice_to_voice"]
        fs = s["metrics"]["first_sentence_latency"]
        print(f"voice-to-voice p50 {_ms(v2v['p50']).strip()} ms, p90 {_ms(v2v['p90']).strip()} ms; "
              f"first sentence p50 {_ms(fs['p50']).strip()} ms; "
              f"LLM {s['llm']['tokens_per_pass']:.2f} tokens/pass, {s['llm']['tokens_per_s']:.1f} tokens/s")
        pre = s.get("preemptive") or {}
        if pre.get("turns"):
            why = ", ".join(f"{k} {v}" for k, v in sorted(pre["discarded"].items())) or "none"
            print(f"preemptive: {pre['hits']} of {pre['turns']} turns kept their early answer "
                  f"({pre['starts']} starts; discarded: {why})")
        print(f"report: {report_path}\nrender it: specvoice report {report_path}")
    elif not args.bridge:
        print("specvoice call: the agent wrote no report", file=sys.stderr)
        return 1
    return 0


def _caller_tts(config):
    """The caller's own voice, for text lines against a remote bridge."""
    from modelstore import resolve_model
    from voice.tts import load_tts

    return load_tts("piper", resolve_model(config.tts.voice), threads=1)
