"""The processes `bench load --spawn` runs: `specvoice serve` bridges (`ServeProcess`, also
the tests' way to run serve as a subprocess) and the one llama.cpp server behind them."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import ROOT
from bench.load.config import spawn_config


def _default_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


class ServeProcess:
    """`specvoice serve --port 0` as a subprocess (its own session), output to a log file;
    `wait_port()` polls the log for the listening line, printed once the models are loaded."""

    LISTENING = re.compile(r"specvoice bridge listening on [^:]+:(\d+)")

    def __init__(self, config: Path, token: str, log: Path) -> None:
        import subprocess

        env = {**os.environ, "SPECVOICE_BRIDGE_TOKEN": token, "PYTHONUNBUFFERED": "1"}
        env.pop("TWILIO_AUTH_TOKEN", None)
        self.log = log
        self._out = open(log, "wb")
        command = [sys.executable, "-m", "demo.cli", "serve", "--port", "0", "--config", str(config)]
        # SIGINT back to its default in the child: a benchmark started in the background by a
        # non-interactive shell has SIGINT ignored, a child would inherit that, and then the
        # SIGINT stop (and the clean-up below) would not reach serve at all.
        self.proc = subprocess.Popen(command,
                                     cwd=ROOT, env=env, stdout=self._out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_default_sigint)
        self.port: int | None = None

    def wait_port(self, timeout_s: float = 600.0) -> int:
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.LISTENING.search(self.tail(100_000))
            if m:
                self.port = int(m.group(1))
                return self.port
            if self.proc.poll() is not None:
                raise RuntimeError(f"specvoice serve exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"specvoice serve was not listening within {timeout_s:g} s:\n{self.tail()}")
            time.sleep(0.2)  # polling the log for the listening line (models loading)

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGINT (the clean stop), SIGKILL if it does not end."""
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._out.close()
        return self.proc.returncode


def start_llm_server(args: argparse.Namespace, log: Path, parallel: int):
    """llama.cpp's server (xllamacpp) for the catalog model's GGUF, through tests/realengine.py
    (run from the source tree): one server, `parallel` slots, behind every spawned process."""
    tests = ROOT / "tests"
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))
    import realengine

    reason = realengine.engine_missing_reason()
    if reason:
        raise RuntimeError(reason)

    class Server(realengine.LlamaServer):
        def command(self) -> list[str]:  # LlamaServer starts one slot; the calls share this server
            return [*super().command(), "--parallel", str(parallel)]

    server = Server(realengine.gguf_file(args.llm_model), threads=args.llm_threads, ctx=2048 * parallel,
                    alias="model", log_path=log)
    return server.start()


def spawn_bridges(args: argparse.Namespace, stack: contextlib.ExitStack, token: str,
                  most: int) -> tuple[list[ServeProcess], list[str], list[Path], dict[str, Any]]:
    """--spawn: the LLM server (unless --llm-url) and args.spawn serve processes, each with its
    own report folder, stopped when `stack` closes; once all listen: (processes, their URLs,
    their report folders, what to record). RuntimeError, with a one-line reason, if one fails."""
    work = args.reports or Path(tempfile.mkdtemp(prefix="specvoice-load-bridges-"))
    work.mkdir(parents=True, exist_ok=True)
    t = time.monotonic()
    meta: dict[str, Any] = {}
    llm_url, llm_name = args.llm_url, args.llm_name
    if not llm_url:
        try:
            server = start_llm_server(args, work / "llm-server.log", parallel=most)
        except Exception as exc:  # noqa: BLE001
            raise RuntimeError(f"cannot start the llama.cpp server: {exc}") from exc
        stack.callback(server.stop)
        llm_url, llm_name = server.base_url, "model"
        meta["llm_server"] = {"engine": "llama.cpp (xllamacpp)", "model": args.llm_model,
                              "threads": args.llm_threads, "slots": most,
                              "startup_s": round(server.startup_s or 0.0, 1)}
    max_calls = args.max_calls or most
    dirs = [work / f"bridge-{i}" for i in range(args.spawn)]
    procs: list[ServeProcess] = []
    for i, d in enumerate(dirs):
        cfg = spawn_config(args, work / f"bridge-{i}.toml", llm_url, llm_name, d, max_calls)
        p = ServeProcess(cfg, token, work / f"bridge-{i}.log")
        stack.callback(p.stop)
        procs.append(p)
    urls = [f"ws://127.0.0.1:{p.wait_port()}/media-stream" for p in procs]
    meta.update({"spawned": args.spawn, "max_calls_each": max_calls, "llm_url": llm_url,
                 "bridges_ready_s": round(time.monotonic() - t, 1)})
    print(f"{args.spawn} bridges listening ({urls}), one LLM server {llm_url}; "
          f"ready in {meta['bridges_ready_s']:.1f} s; reports and logs in {work}", flush=True)
    return procs, urls, dirs, meta
