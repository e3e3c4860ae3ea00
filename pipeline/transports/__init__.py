"""Transports: where a call's audio comes from and goes to.

    telephony/   Twilio Media Streams: protocol, WebSocket server, auth, and the adapter
                 to the call's ports (the only place that knows the Twilio protocol)
    local_audio  the microphone and speakers (`specvoice mic`)

In-process audio (a source fed by code, a sink that records) is pipeline/io.py. Every
transport supplies a source and a FrameWriter for the one paced output (pipeline/playout.py).
"""
