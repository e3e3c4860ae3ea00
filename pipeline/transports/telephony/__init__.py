"""Telephony: the Twilio Media Streams protocol, end to end, in one package.

    protocol      parse / serialize the WebSocket messages (connected, start, media, dtmf, mark, stop;
                  outbound media, mark, clear)
    auth          Twilio's X-Twilio-Signature and bearer tokens
    twiml         the TwiML the webhooks answer with (<Connect><Stream>, <Dial>, <Hangup/>)
    call          TelephonyCall: one call's inbound events and paced output (TwilioWriter)
    media_stream  one Media Streams connection: messages in, a TelephonyCall, close codes
    adapter       a TelephonyCall as a Call's source and sink (make_call_handler)
    far_end       the far end of a stream, as Twilio plays it (the simulated caller, load tests)

The HTTP server that serves the webhooks and the stream is pipeline/transports/web.
"""
