"""`specvoice bench engine` on tiny shapes (CPU), and the oracle drafter it relies on."""

import json
import math

import pytest
import torch

from demo.cli import main
from llm.oracle import OracleDrafter, measured_acceptance
from llm.types import SamplingParams

ROW_FIELDS = {
    "acceptance", "gamma", "tokens_per_s", "speedup_vs_target_only", "speedup_vs_hf_generate", "tokens_per_pass",
    "expected_tokens_per_pass", "measured_acceptance", "drafted", "accepted", "rejections", "oracle_cost_per_token_s",
    "predicted_speedup", "efficiency", "predicted_speedup_realised", "efficiency_realised",
    "predicted_speedup_model_draft", "exact_vs_target_only",
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "engine.json"
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", "engine", "--shapes", "small", "--device", "cpu", "--acceptance", "0.8",
                   "--gammas", "1", "3", "--new-tokens", "16", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    return json.loads(out.read_text())


def test_bench_engine_writes_documented_json(report):
    assert report["benchmark"] == "engine" and report["shapes"] == "small"
    c = report["config"]
    assert c["device"] == "cpu" and c["fixed_width"] is True and c["cuda_graphs"] is False and c["verify_width"] == 4
    assert set(report["step_costs_s"]["target"]) == {"1", "2", "3", "4"}
    assert set(report["step_costs_s"]["draft"]) == {"1", "4"}
    assert report["verify_cost_ratio"]["1"] == 1.0
    assert all(v > 0 for v in report["verify_cost_ratio"].values())
    assert report["draft_step_ratio"] > 0
    assert report["target_only"]["tokens_per_s"] > 0
    assert report["hf_generate"]["tokens_per_s"] > 0
    rows = report["results"]
    assert [(r["acceptance"], r["gamma"]) for r in rows] == [(0.8, 1), (0.8, 3)]
    for r in rows:
        assert ROW_FIELDS <= set(r)
        assert r["tokens_per_s"] > 0 and r["predicted_speedup"] > 0 and r["efficiency"] > 0
        assert r["expected_tokens_per_pass"] == pytest.approx((1 - 0.8 ** (r["gamma"] + 1)) / 0.2)
        assert r["oracle_cost_per_token_s"] < 1e-3  # the oracle costs ~nothing


def test_bench_engine_output_identical_to_gamma0(report):
    assert report["all_exact"] and all(r["exact_vs_target_only"] for r in report["results"])
    # Random weights of a small model, float32 on CPU: the same tokens as HF generate.
    assert report["hf_generate"]["exact_vs_target_only"] is True


def test_bench_engine_realised_acceptance_near_a(report):
    for r in report["results"]:
        trials = r["accepted"] + r["rejections"]
        assert trials >= 5
        # Binomial scatter of an estimate from `trials` Bernoulli(a) draws: 4 standard deviations.
        assert abs(r["measured_acceptance"] - 0.8) <= 4 * math.sqrt(0.8 * 0.2 / trials)


@pytest.mark.parametrize("a", [0.6, 0.8, 0.9])
def test_oracle_corrupts_with_probability_1_minus_a(a):
    prompt, ref = [1, 2, 3], list(range(10, 4010))
    oracle = OracleDrafter(prompt, ref, a, vocab_size=5000, seed=7)
    kept = total = 0
    for pos in range(0, len(ref) - 8, 8):
        p = oracle.propose(prompt + ref[:pos], 8, SamplingParams())
        assert len(p.tokens) == 8 and p.probs is None and p.source == "oracle"
        kept += sum(t == r for t, r in zip(p.tokens, ref[pos : pos + 8]))
        total += 8
        assert all(0 <= t < 5000 for t in p.tokens)
    assert oracle.corrupted == total - kept  # a corrupted token always differs
    assert abs(kept / total - a) < 4 * math.sqrt(a * (1 - a) / total)
    # Same seed, same proposals; off the reference, nothing.
    again = OracleDrafter(prompt, ref, a, vocab_size=5000, seed=7)
    assert again.propose(prompt, 8, SamplingParams()).tokens == OracleDrafter(prompt, ref, a, 5000, seed=7).propose(prompt, 8, SamplingParams()).tokens
    assert again.propose(prompt + [99], 8, SamplingParams()).tokens == []


def test_measured_acceptance_estimator():
    assert measured_acceptance(8, 10, 2) == 0.8
    assert measured_acceptance(0, 0, 0) == 0.0
