"""Greedy answers from an OpenAI-compatible server for the benchmark's 24 dialogue turns,
to compare a server's speculative decoding against the same server without it.

    python -m bench.openai_answers --url http://127.0.0.1:8001/v1 --model qwen --label vllm-nospec --out a.json
    python -m bench.openai_answers --url http://127.0.0.1:8001/v1 --model qwen --label vllm-ngram --out b.json
    python -m bench.openai_answers --ours default --out ours.json  # this engine: ours-gamma0.json, ours-spec.json
    python -m bench.openai_answers --compare a.json b.json      # identical answers, first difference

Each turn (bench/data/dialogues.json, the turns `specvoice bench llm` uses) is sent once,
temperature 0, `max_tokens` tokens, not streamed; the answer text, its completion tokens
and the wall time are saved. With --compare, the first file is the reference: for every
other file, how many answers are identical and where the first differing one departs.
A measurement script (the server side needs only the standard library), not part of the product.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

from bench import DIALOGUES



def ask(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = json.dumps({"model": model, "messages": messages, "temperature": 0.0, "max_tokens": max_tokens,
                       "seed": 0}).encode()
    req = urllib.request.Request(f"{url.rstrip('/')}/chat/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        data = json.load(resp)
    seconds = time.perf_counter() - t0
    choice = data["choices"][0]
    return {"text": choice["message"]["content"], "finish_reason": choice.get("finish_reason"),
            "completion_tokens": (data.get("usage") or {}).get("completion_tokens"), "seconds": seconds}


def collect(args: argparse.Namespace) -> int:
    turns = json.loads(args.dialogues.read_text())["turns"]
    answers = []
    for i, turn in enumerate(turns, 1):
        a = ask(args.url, args.model, turn["messages"], args.max_tokens)
        answers.append(a)
        print(f"[{i}/{len(turns)}] {a['seconds']:.1f}s {a['completion_tokens']} tokens: {a['text'][:70]!r}",
              file=sys.stderr, flush=True)
    tokens = sum(a["completion_tokens"] or 0 for a in answers)
    seconds = sum(a["seconds"] for a in answers)
    out = {"label": args.label, "url": args.url, "model": args.model, "max_tokens": args.max_tokens,
           "turns": len(answers), "completion_tokens": tokens, "seconds": seconds,
           "tokens_per_s": tokens / seconds if seconds else None, "answers": answers}
    args.out.write_text(json.dumps(out, indent=1))
    print(f"{args.label}: {tokens} tokens in {seconds:.1f} s ({out['tokens_per_s']:.2f} tokens/s); wrote {args.out}")
    return 0


def collect_ours(args: argparse.Namespace) -> int:
    """The same turns through this product's engine (the config's target, int8), once at
    gamma 0 and once with the config's drafter: two files, `<out>-gamma0.json` and `<out>-spec.json`."""
    from llm.types import SamplingParams
    from pipeline.agent import load_engine
    from pipeline.config import load_config

    cfg = load_config(args.ours).llm
    engine = load_engine(cfg, answer_memory=0)  # the drafter then answers what gamma 0 did
    turns = json.loads(args.dialogues.read_text())["turns"]
    params = SamplingParams(max_new_tokens=args.max_tokens)
    settings = {"gamma0": ("none", 0), "spec": (cfg.drafter, cfg.gamma)}
    for mode, (drafter, gamma) in settings.items():
        engine.drafter, engine.gamma = drafter, gamma
        answers = []
        for i, turn in enumerate(turns, 1):
            t0 = time.perf_counter()
            ids, groups, stats = engine.generate(engine.chat_prompt(turn["messages"]), params)  # a new conversation each
            seconds = time.perf_counter() - t0
            answers.append({"text": "".join(g.text for g in groups), "finish_reason": groups[-1].finish_reason,
                            "completion_tokens": len(ids), "seconds": seconds})
            print(f"[{mode} {i}/{len(turns)}] {seconds:.1f}s {len(ids)} tokens", file=sys.stderr, flush=True)
        tokens = sum(a["completion_tokens"] for a in answers)
        seconds = sum(a["seconds"] for a in answers)
        out = {"label": f"ours-{cfg.dtype}-{mode}", "config": args.ours, "max_tokens": args.max_tokens,
               "turns": len(answers), "completion_tokens": tokens, "seconds": seconds,
               "tokens_per_s": tokens / seconds, "answers": answers}
        path = args.out.with_name(f"{args.out.stem}-{mode}.json")
        path.write_text(json.dumps(out, indent=1))
        print(f"{out['label']}: {tokens} tokens in {seconds:.1f} s ({out['tokens_per_s']:.2f} tokens/s); wrote {path}")
    return 0


def compare(paths: list[Path]) -> int:
    runs = [json.loads(p.read_text()) for p in paths]
    ref = runs[0]
    print(f"reference: {ref['label']} ({ref['tokens_per_s']:.2f} tokens/s)")
    for run in runs[1:]:
        same = [a["text"] == b["text"] for a, b in zip(ref["answers"], run["answers"])]
        print(f"{run['label']}: {sum(same)}/{len(same)} answers identical, {run['tokens_per_s']:.2f} tokens/s")
        for i, ok in enumerate(same):
            if not ok:
                a, b = ref["answers"][i]["text"], run["answers"][i]["text"]
                k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                print(f"  turn {i + 1}: ...{a[max(0, k - 30):k + 40]!r}\n  {'':{len(str(i + 1)) + 7}}...{b[max(0, k - 30):k + 40]!r}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="the server's /v1 base URL")
    p.add_argument("--model", default="qwen", help="the served model name")
    p.add_argument("--label", default="server")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dialogues", type=Path, default=DIALOGUES)
    p.add_argument("--out", type=Path)
    p.add_argument("--ours", metavar="CONFIG", help="no server: this product's engine with this config, gamma 0 and speculation")
    p.add_argument("--compare", nargs="+", type=Path, metavar="JSON", help="compare saved runs (first = reference)")
    args = p.parse_args(argv)
    if args.compare:
        return compare(args.compare)
    if args.ours:
        if not args.out:
            p.error("give --out with --ours")
        return collect_ours(args)
    if not (args.url and args.out):
        p.error("give --url and --out (or --compare)")
    return collect(args)


if __name__ == "__main__":
    sys.exit(main())
