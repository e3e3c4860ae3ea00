"""Telephony: the Twilio Media Streams protocol, end to end, in one package.

    protocol  parse / serialize the WebSocket messages (connected, start, media, dtmf, mark, stop;
              outbound media, mark, clear)
    auth      Twilio's X-Twilio-Signature and bearer tokens at the handshake
    server    the bridge: WebSocket server, TwiML webhook, /health, one TelephonyCall per connection
    adapter   a TelephonyCall as a Call's source and sink (make_call_handler)
"""
