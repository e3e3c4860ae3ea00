"""`specvoice serve`'s HTTP server: one ASGI app (Starlette) on uvicorn, one port.

    server    Bridge: uvicorn's lifecycle, call slots (max_calls), drain, stop
    app       the routes (Twilio's webhooks and stream, the page and its call, /calls, /metrics, /health)
    webhooks  Twilio's voice webhook (form POST or GET, signature over URL + POST parameters), stream-ended
    access    who may use what: Twilio signatures / bearer on Twilio's paths; a token off loopback for people
    browser   a call from the page: PCM over its WebSocket, marks echoed once played, events to the page
    sockets   an ASGI WebSocket as the calls' socket (who closed it, when it is really gone)
    adapter   a browser call as a Call's ports (make_browser_handler)
    pages     the call page, recent calls, report pages and recordings
    metrics   Prometheus metrics from the calls' report entries
    static/   the call page: HTML, script, AudioWorklets (capture and playback)

The Twilio wire format and the media stream loop stay in transports/telephony; this
package names no Twilio message.
"""
