"""`specvoice bench batch` (bench/batch.py) on a tiny model: its figures add up and
its exactness check holds."""

import argparse

import torch

from llm.engine import SpeculativeEngine


def test_run_level_counts_and_matches_alone(tiny_models):
    from bench import batch

    torch.set_num_threads(1)
    eng = SpeculativeEngine.load(tiny_models["target"], drafter="ngram", gamma=3, dtype="int8", calibrate=False,
                                 gather_s=20.0)
    prompts = [eng.encode(t) for t in ("Hello! How can I help you today? Hello!", "A cleaning costs $89. A cleaning")]
    alone = [batch.run_level(eng, [p], 12)["calls"][0]["ids"] for p in prompts]
    eng.close()
    r = batch.run_level(eng, prompts, 12)
    assert [c["ids"] for c in r["calls"]] == alone
    assert r["tokens"] == sum(len(ids) for ids in alone)
    assert r["batched_passes"] >= 1 and r["conversations_per_pass"] > 1
    assert r["aggregate_tokens_per_s"] > 0 and r["per_call_tokens_per_s_min"] <= r["per_call_tokens_per_s_median"]
    assert r["decode_aggregate_tokens_per_s"] > 0 and 0 < r["decode_window_s"] <= r["wall_s"]
    # Every call's first sentence (the stream's end at the latest), within its own run.
    firsts = [c["first_sentence_s"] for c in r["calls"]]
    assert all(f is not None and 0 < f <= c["seconds"] for f, c in zip(firsts, r["calls"]))
    assert min(firsts) <= r["first_sentence_s_p50"] <= r["first_sentence_s_p90"] <= max(firsts)
    # Prompts read before the clock: the same tokens, every call decoding from the start, so
    # the decoding window is most of the run and the prompts' rows are not in it.
    eng.close()
    first = batch.run_level(eng, prompts, 12, prefill_first=True)
    assert [c["ids"] for c in first["calls"]] == alone
    assert first["rows_per_pass"] < r["rows_per_pass"]
    assert first["decode_window_s"] > 0 and first["decode_aggregate_tokens_per_s"] > 0
    costs = batch.pass_costs(eng.target.model, shapes=((1, 1), (3, 2)), context=20, repeats=1)
    assert set(costs) == {"1x1", "3x2"} and all(v > 0 for v in costs.values())


def test_arguments():
    from bench import batch

    p = argparse.ArgumentParser()
    batch.add_arguments(p)
    args = p.parse_args(["--calls", "1", "4", "--modes", "spec", "--serve", "batched"])
    assert args.calls == [1, 4] and args.modes == "spec" and batch.HELP
