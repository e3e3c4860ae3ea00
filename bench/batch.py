"""`specvoice bench batch`: N concurrent calls on one engine, passes batched across calls.

A benchmark, not a test. Register as ("batch", "bench.batch") in demo/commands/bench.py.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from pathlib import Path

from bench import DIALOGUES

HELP = "N concurrent conversations on one engine: batched passes vs one pass at a time, gamma 0 vs speculation"
DESCRIPTION = """\
Runs N conversations at once on ONE engine, each on its own thread as calls are
(different voice-agent turns from bench/data/dialogues.json, greedy, same token budget),
for each N in --calls and each mode:

  gamma0       plain decoding (no drafter)
  spec         the config's drafter with adaptive gamma (each conversation's gamma chosen
               for the batch it is in)

and each way of serving them (--serve): `batched`, the engine thread runs the rows of all
waiting conversations as one target forward, and the draft model's steps (with a config
whose drafter is "model" or "hybrid") as one draft forward each; `serial`, the same
thread runs one conversation's pass at a time; `drafts_apart`, target rows batched but
each conversation's draft steps run on their own (what batching the draft brings). Per run: wall time, aggregate tokens/s (all tokens over
the wall time), per-call tokens/s (median), target passes, conversations and rows per
pass, and the aggregate tokens/s while every call is decoding (prefills excluded). Then
the cost of one target forward by conversations x rows (1x1, 4x1, 4x9, ...). Every
run's tokens are checked against that conversation run alone (greedy: they must be
identical; a mismatch is reported, never hidden).

  specvoice bench batch --calls 1 2 4 --out batch.json
  specvoice bench batch --calls 4 --modes spec --serve batched --max-new-tokens 32
  specvoice bench batch --config draft.toml --modes spec --serve batched,drafts_apart
"""

MODES = ("gamma0", "spec")
SERVES = ("batched", "serial", "drafts_apart")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="config name or TOML file (models, drafter, device, dtype)")
    p.add_argument("--calls", type=int, nargs="+", default=[1, 2, 4], help="concurrent conversations per level (default 1 2 4)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--serve", default="batched,serial", help=f"comma-separated subset of {','.join(SERVES)} (default: batched,serial)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the config's, else all cores)")
    p.add_argument("--prefill-first", action="store_true",
                   help="each call reads its prompt before the clock starts: all decode together, so the "
                        "decoding figures cover whole answers (first sentence then excludes the prompt)")
    p.add_argument("--dialogues", type=Path, default=DIALOGUES)
    p.add_argument("--out", type=Path, help="write the JSON results here")


def run_level(engine, prompts: list[list[int]], max_new: int, prefill_first: bool = False) -> dict:
    """All prompts at once, one thread each; wall time, per-call stats and token ids.
    prefill_first: each call reads its prompt before the start (a one-token generation
    that leaves the prompt's K/V in its conversation), so all of them start decoding
    together and the decoding window is the whole answer, not the gap between prefills."""
    from llm.types import SamplingParams

    n = len(prompts)
    ready = threading.Barrier(n + 1)  # every call prefilled (when asked): counting starts
    go = threading.Barrier(n + 1)
    out: list[dict] = [{} for _ in range(n)]

    def call(i: int) -> None:
        from bench.llm import FirstSentenceClock

        conv = engine.new_conversation()
        if prefill_first:
            for _ in engine.stream(prompts[i], SamplingParams(max_new_tokens=1), conv):
                pass
        ready.wait()
        go.wait()
        ids, stamps = [], []
        t0 = time.perf_counter()
        clock = FirstSentenceClock(t0)  # what a caller waits for: the first sentence to speak
        for g in engine.stream(prompts[i], SamplingParams(max_new_tokens=max_new), conv):
            ids.extend(g.token_ids)
            stamps.append((g.timestamp, len(g.token_ids)))
            clock.feed(g.text, len(g.token_ids), time.perf_counter())
        clock.end(time.perf_counter())
        st = conv.last_stats
        out[i] = {"ids": ids, "stamps": stamps, "seconds": time.perf_counter() - t0, "tokens": len(ids), "passes": st.passes,
                  "tokens_per_s": len(ids) / (time.perf_counter() - t0), "mean_gamma": st.as_dict()["mean_gamma"],
                  "acceptance_rate": st.acceptance_rate, "ttft_s": st.ttft_s, "first_sentence_s": clock.first_sentence}

    sched = engine.scheduler
    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    ready.wait()
    before = (sched.passes, sched.batched_passes, sched.rows, sched.rounds)
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    passes, batched, rows, _ = (a - b for a, b in zip((sched.passes, sched.batched_passes, sched.rows, sched.rounds), before))
    tokens = sum(c["tokens"] for c in out)
    per_call = sorted(c["tokens_per_s"] for c in out)
    # Decoding in steady state: the window where every call has its first token and none
    # has finished (prefills excluded), all calls' tokens in it over its length.
    start = max(c["stamps"][0][0] for c in out)
    end = min(c["stamps"][-1][0] for c in out)
    in_window = sum(n for c in out for t, n in c["stamps"] if start < t <= end)
    for c in out:
        del c["stamps"]
    conv_passes = sum(c["passes"] for c in out)
    firsts = sorted(c["first_sentence_s"] for c in out if c["first_sentence_s"] is not None)
    return {
        "first_sentence_s_p50": firsts[len(firsts) // 2] if firsts else None,
        "first_sentence_s_p90": firsts[min(len(firsts) - 1, int(0.9 * len(firsts)))] if firsts else None,
        "wall_s": wall,
        "tokens": tokens,
        "aggregate_tokens_per_s": tokens / wall,
        "decode_window_s": end - start,
        "decode_aggregate_tokens_per_s": in_window / (end - start) if end > start else None,
        "per_call_tokens_per_s_median": per_call[len(per_call) // 2],
        "per_call_tokens_per_s_min": per_call[0],
        "target_passes": passes,
        "batched_passes": batched,
        "conversations_per_pass": conv_passes / passes if passes else None,
        "rows_per_pass": rows / passes if passes else None,
        "mean_gamma": sum(c["mean_gamma"] for c in out) / n,
        "calls": out,
    }


def pass_costs(model, shapes=((1, 1), (2, 1), (4, 1), (1, 4), (2, 4), (4, 4), (1, 9), (4, 9)),
               context: int = 200, repeats: int = 3) -> dict[str, float]:
    """Seconds of one target forward over n conversations x r rows each ("nxr"), every
    conversation at `context` tokens: the cost of a pass by the rows in it (best of repeats)."""
    import torch

    from llm.model import Segment, forward, forward_many, new_cache

    ids = torch.arange(context + 9, device=model.device) % model.args.vocab_size
    most = max(n for n, _ in shapes)
    caches = []
    with torch.inference_mode():
        for _ in range(most):
            cache = new_cache(model, context + 16)
            forward(model, cache, ids[:context], 0, all_logits=False)
            caches.append(cache)
        costs = {}
        for n, r in shapes:
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                forward_many(model, [Segment(caches[i], ids[context : context + r], context) for i in range(n)])
                best = min(best, time.perf_counter() - t0)
            costs[f"{n}x{r}"] = best
    return costs


def run(args: argparse.Namespace) -> int:
    import torch

    from pipeline.agent import load_engine
    from pipeline.config import load_config

    modes = [m for m in args.modes.split(",") if m]
    serves = [s for s in args.serve.split(",") if s]
    bad = [m for m in modes if m not in MODES] + [s for s in serves if s not in SERVES]
    if bad:
        print(f"error: unknown mode(s) {bad}", file=sys.stderr)
        return 2
    cfg = load_config(args.config).llm
    threads = args.threads or cfg.threads
    if threads:
        torch.set_num_threads(threads)
    drafter = cfg.drafter if cfg.drafter != "none" else "ngram"
    print(f"loading {cfg.target} ({drafter}, {cfg.device}, {cfg.dtype}) ...", file=sys.stderr)
    engine = load_engine(cfg, drafter=drafter, gamma="auto", answer_memory=0)  # levels repeat the prompts
    turns = json.loads(args.dialogues.read_text())["turns"]
    n_max = max(args.calls)
    prompts = [engine.chat_prompt(turns[i % len(turns)]["messages"]) for i in range(n_max)]
    settings = {"gamma0": ("none", 0), "spec": (drafter, "auto")}

    # Each conversation alone (the reference for exactness), which also warms up.
    alone: dict[int, list[int]] = {}
    engine.drafter, engine.gamma = "none", 0
    for i in range(n_max):
        alone[i] = run_level(engine, [prompts[i]], args.max_new_tokens)["calls"][0]["ids"]

    results = []
    for n in args.calls:
        for mode in modes:
            for serve in serves:
                engine.close()
                engine.batched = serve in ("batched", "drafts_apart")
                engine.batch_drafts = serve == "batched"
                engine.drafter, engine.gamma = settings[mode]
                engine.learned = None
                r = run_level(engine, prompts[:n], args.max_new_tokens, args.prefill_first)
                r["exact"] = all(c["ids"] == alone[i] for i, c in enumerate(r["calls"]))
                for c in r["calls"]:
                    del c["ids"]
                r.update(calls_at_once=n, mode=mode, serve=serve)
                results.append(r)
                print(f"N={n} {mode:6} {serve:7} aggregate {r['aggregate_tokens_per_s']:6.2f} tok/s  decoding "
                      f"{r['decode_aggregate_tokens_per_s'] or 0:6.2f}  per call "
                      f"{r['per_call_tokens_per_s_median']:6.2f}  passes {r['target_passes']:4}  conv/pass "
                      f"{r['conversations_per_pass'] or 0:4.2f}  rows/pass {r['rows_per_pass'] or 0:5.2f}  "
                      f"gamma {r['mean_gamma']:4.2f}  1st sentence p50 {r['first_sentence_s_p50'] or 0:5.2f} s  "
                      f"exact {r['exact']}", file=sys.stderr)
    engine.close()
    costs = pass_costs(engine.target.model)
    print("pass cost by conversations x rows: " + ", ".join(
        f"{k} {v * 1e3:.0f} ms ({v / costs['1x1']:.2f}x)" for k, v in costs.items()), file=sys.stderr)
    report = {
        "config": {"target": cfg.target, "drafter": drafter, "device": cfg.device, "dtype": cfg.dtype,
                   "max_new_tokens": args.max_new_tokens, "prefill_first": args.prefill_first, "threads": torch.get_num_threads(),
                   "machine": platform.processor() or platform.machine()},
        "step_costs_s": engine.step_costs,
        "pass_cost_s": costs,
        "pass_cost_vs_1x1": {k: v / costs["1x1"] for k, v in costs.items()},
        "runs": results,
    }
    base = {(r["mode"], r["serve"]): r["aggregate_tokens_per_s"] for r in results if r["calls_at_once"] == 1}
    for r in results:
        ref = base.get(("gamma0", r["serve"])) or base.get(("gamma0", "batched"))
        r["aggregate_vs_gamma0_alone"] = r["aggregate_tokens_per_s"] / ref if ref else None
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)
    ok = all(r["exact"] for r in results)
    return 0 if ok else 1
