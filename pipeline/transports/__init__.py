"""Transports: where a call's audio comes from and goes to.

    telephony/   Twilio Media Streams: protocol, WebSocket server, auth, and the adapter
                 to the call's ports (the only place that knows the Twilio protocol)
    web/         `specvoice serve`'s HTTP server (ASGI on uvicorn): Twilio's webhooks and stream,
                 the browser call page and its call, /calls, /metrics
    local_audio  the microphone and speakers (`specvoice mic`)
    recording    both sides of a call on one clock, a stereo WAV beside its report

In-process audio (a source fed by code, a sink that records) is pipeline/io.py. Every
transport supplies a source and a FrameWriter for the one paced output (pipeline/playout.py).
"""
