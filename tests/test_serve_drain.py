"""`specvoice serve` stopped by SIGTERM (systemd, Docker, Kubernetes): it drains. New calls
and /health get 503, the call in progress goes on to its end and its report is written as
the caller ended it, then the process exits 0. The real process, the real models of the
`test` config, a real WebSocket caller."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest
from websockets.exceptions import InvalidStatus

from callfakes import TOKEN, RawCaller, silence_mulaw
from conftest import require_model
from bench.load.serve import ServeProcess

pytestmark = [pytest.mark.models, pytest.mark.timeout(300)]


def serve_config(tmp_path, drain_s: float):
    path = tmp_path / "serve.toml"
    path.write_text(f"""base = "test"

[stt]
model = "whisper-tiny.en"

[report]
dir = {json.dumps(str(tmp_path / "reports"))}

[bridge]
max_calls = 2
drain_s = {drain_s}

[mqtt]
enabled = false
""")
    return path


async def test_sigterm_drains_the_call_in_progress_then_exits(tmp_path):
    for name in ("whisper-tiny.en", "piper-joe-medium", "smollm2-135m-instruct"):
        require_model(name)

    serve = ServeProcess(serve_config(tmp_path, drain_s=60), TOKEN, tmp_path / "serve.log")
    try:
        port = await asyncio.to_thread(serve.wait_port, 240)
        caller = await RawCaller(port).open()
        await caller.send_audio(silence_mulaw(0.3))
        serve.proc.send_signal(signal.SIGTERM)
        async with httpx.AsyncClient() as client:
            # The signal is handled on the other process's loop: poll its /health until it is
            # (a generous bound: a slow machine still handles a signal in far less).
            for _ in range(600):
                health = await client.get(f"http://127.0.0.1:{port}/health")
                if health.status_code == 503:
                    break
                await asyncio.sleep(0.05)
            assert health.status_code == 503 and health.json()["draining"] is True, serve.tail()
            assert health.json()["calls_active"] == 1
        with pytest.raises(InvalidStatus) as refused:
            await RawCaller(port).open()
        assert refused.value.response.status_code == 503
        # The call in progress is still being served: the connection stays open while the
        # caller goes on, until the caller ends it.
        await caller.send_audio(silence_mulaw(1.0))
        assert serve.proc.poll() is None and caller.ws.close_code is None
        await caller.stop()
        assert await caller.wait_closed() is not None
        code = await asyncio.to_thread(serve.proc.wait, 60)
        assert code == 0, serve.tail()
        reports = list((tmp_path / "reports").glob("*.json"))
        assert len(reports) == 1, serve.tail()
        assert json.loads(reports[0].read_text())["end_reason"] != "server_shutdown"
        assert "draining" in serve.tail()
    finally:
        if serve.proc.poll() is None:
            serve.proc.kill()
            serve.proc.wait(timeout=30)
        serve.stop()

