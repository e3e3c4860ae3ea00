"""`specvoice bench llm` on tiny models: every mode side by side, the documented JSON, and
the prompt-lookup ceiling it reports."""

import json

import pytest
import torch

from bench.llm import MODES, prompt_lookup_ceiling
from demo.cli import main

FIELDS = {"tokens_per_s", "tokens_per_pass", "acceptance_rate", "ttft_s", "first_sentence_s",
          "exact_vs_target_only", "exact_vs_hf_generate"}
LINEAR = {k: 1.0 + 0.1 * (k - 1) for k in range(1, 10)}  # a k-row verify costs 1 + 0.1 (k - 1)


def test_ceiling_drafts_the_longest_earlier_continuation():
    # Pass 1: the context ends in 6, which occurs nowhere earlier: no draft, the target adds 3.
    # Pass 2: 3 occurred before, followed by 4 5 6: three drafts accepted, the target adds 9.
    c = prompt_lookup_ceiling([[1, 2, 3, 4, 5, 6]], [[3, 4, 5, 6, 9]], LINEAR)
    assert c["tokens_per_pass"] == pytest.approx(5 / 2)
    assert c["speedup_vs_target_only"] == pytest.approx(5 * 1.0 / (LINEAR[1] + LINEAR[4]))


def test_ceiling_is_plain_decoding_when_nothing_repeats_and_is_capped_by_the_widest_verify():
    c = prompt_lookup_ceiling([[1, 2, 3]], [[4, 5, 6, 7]], LINEAR)
    assert c == {"tokens_per_pass": 1.0, "speedup_vs_target_only": 1.0}
    # A long copy, but verifies are at most 3 rows wide: at most 2 drafts a pass.
    prompt, answer = list(range(10, 30)), list(range(11, 30))
    narrow = prompt_lookup_ceiling([prompt], [answer], {1: 1.0, 2: 1.1, 3: 1.2})
    wide = prompt_lookup_ceiling([prompt], [answer], LINEAR)
    assert narrow["tokens_per_pass"] <= 3.0 < wide["tokens_per_pass"]


def test_ceiling_never_uses_the_answer_itself_before_it_is_generated():
    # The answer repeats itself, but the prompt holds none of it: the first half is plain
    # decoding and only the second copy can be drafted (from the first).
    answer = [5, 6, 7, 8, 5, 6, 7, 8]
    c = prompt_lookup_ceiling([[1, 2]], [answer], LINEAR)
    assert 1.0 < c["tokens_per_pass"] < len(answer) / 2


@pytest.fixture(scope="module")
def report(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_llm")
    config = root / "tiny.toml"
    config.write_text(
        "[llm]\n"
        f'target = "{tiny_models["target"]}"\n'
        f'draft = "{tiny_models["target"]}"\n'
        'device = "cpu"\ndtype = "float32"\nmax_gamma = 4\n'
    )
    turns = [
        {"id": "copy", "messages": [
            {"role": "system", "content": "Riverside Dental is open Monday to Friday from 8 a.m. to 6 p.m."},
            {"role": "user", "content": "Riverside Dental is open Monday to"}]},
        {"id": "price", "messages": [
            {"role": "system", "content": "A cleaning costs $89, a check-up $59."},
            {"role": "user", "content": "Hello! How can I help you today?"},
            {"role": "assistant", "content": "A cleaning costs $89."},
            {"role": "user", "content": "A cleaning costs"}]},
    ]
    dialogues = root / "dialogues.json"
    dialogues.write_text(json.dumps({"turns": turns}))
    out = root / "llm.json"
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", "llm", "--config", str(config), "--dialogues", str(dialogues), "--hf-dtype", "float32",
                   "--max-new-tokens", "12", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    return json.loads(out.read_text())


def test_bench_llm_reports_every_mode_with_the_documented_fields(report):
    assert set(report["modes"]) == set(MODES)
    assert report["turns"] == 2 and report["max_new_tokens"] == 12
    for mode, entry in report["modes"].items():
        assert FIELDS <= set(entry), mode
        assert entry["tokens_per_s"] > 0, mode
        assert len(entry["per_turn"]) == 2
        assert set(entry["speedup_vs_target_only"]) == {"median", "worst", "mean"}
        assert set(entry["speedup_vs_hf_assisted"]) == {"median", "worst", "mean"}
    assert report["modes"]["target_only"]["speedup_vs_target_only"]["median"] == pytest.approx(1.0)


def test_bench_llm_speculative_modes_are_exact_and_match_hf_generate(report):
    modes = report["modes"]
    for mode in ("target_only", "spec_model", "spec_ngram", "spec_hybrid"):
        assert modes[mode]["exact_vs_target_only"] == 1.0, mode
        # Same float32 weights: our decoding is token-identical to Hugging Face generate().
        assert modes[mode]["exact_vs_hf_generate"] == 1.0, mode
    assert modes["hf_generate"]["exact_vs_target_only"] == 1.0
    # Passes and drafts are counted: never less than one token per pass, and an acceptance
    # rate only where something was drafted (adaptive gamma may decline a draft as costly
    # as the target, which this one is).
    for mode in ("spec_model", "spec_ngram", "spec_hybrid"):
        e = modes[mode]
        assert e["tokens_per_pass"] >= 1.0
        drafted = sum(t["drafted"] for t in e["per_turn"])
        assert (e["acceptance_rate"] is None) == (drafted == 0)


def test_bench_llm_reports_verify_costs_and_the_lookup_ceiling(report):
    a = report["analysis"]
    assert set(a["verify_cost_ratio"]) == {str(k) for k in range(1, 6)}  # max_gamma 4: up to 5 rows
    assert a["verify_cost_ratio"]["1"] == 1.0
    c = a["prompt_lookup_ceiling"]
    # A random model's answers need not quote their prompts: the bound is at least plain decoding.
    assert c["tokens_per_pass"] >= 1.0 and c["speedup_vs_target_only"] > 0


def test_bench_llm_reports_the_worst_turn_the_gammas_and_never_slower(report):
    modes = report["modes"]
    for mode in ("spec_model", "spec_ngram", "spec_hybrid"):
        e = modes[mode]
        assert e["worst_turn"]["id"] in ("copy", "price")
        assert e["worst_turn"]["speedup_vs_target_only"] == pytest.approx(e["speedup_vs_target_only"]["worst"])
        g = e["gamma"]
        assert 0.0 <= g["share_at_0"] <= 1.0 and len(g["per_turn_mean"]) == 2
        assert sum(g["histogram"].values()) == sum(t["passes"] - 1 for t in e["per_turn"])
    worst = [modes[m]["speedup_vs_target_only"]["worst"] for m in ("spec_model", "spec_ngram", "spec_hybrid")]
    assert report["never_slower"] is all(w >= 0.97 for w in worst)
    # The controller's per-pass record travels in the JSON: gamma, drafter, expected vs measured.
    trace = report["traces"]["spec_ngram"][0]
    assert trace and {"g", "source", "expected_rate", "verify_s", "estimated_verify_s"} <= set(trace[0])


def test_never_slower_is_judged_on_the_speculative_modes_worst_turns():
    from bench.llm import never_slower

    def entry(worst):
        return {"speedup_vs_target_only": {"median": 1.2, "worst": worst, "mean": 1.2}}

    assert never_slower({"target_only": entry(1.0), "spec_ngram": entry(0.98), "hf_assisted": entry(0.4)}) is True
    assert never_slower({"target_only": entry(1.0), "spec_ngram": entry(0.98), "spec_hybrid": entry(0.95)}) is False
    assert never_slower({"hf_generate": entry(1.0)}) is None


def test_bench_llm_repeats_keep_each_modes_median_run(tiny_models, tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text("[llm]\n" f'target = "{tiny_models["target"]}"\n' f'draft = "{tiny_models["target"]}"\n'
                      'device = "cpu"\ndtype = "float32"\nmax_gamma = 4\n')
    dialogues = tmp_path / "d.json"
    dialogues.write_text(json.dumps({"turns": [{"id": "copy", "messages": [
        {"role": "system", "content": "Riverside Dental is open Monday to Friday from 8 a.m. to 6 p.m."},
        {"role": "user", "content": "Riverside Dental is open Monday to"}]}]}))
    out = tmp_path / "r.json"
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", "llm", "--config", str(config), "--dialogues", str(dialogues), "--modes",
                   "target_only,spec_ngram", "--repeats", "3", "--max-new-tokens", "10", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["repeats"] == 3
    assert report["modes"]["spec_ngram"]["exact_vs_target_only"] == 1.0
    assert len(report["modes"]["spec_ngram"]["per_turn"]) == 1  # one turn, its median run


def test_pass_units_speedup_judges_a_turn_on_its_own_passes():
    from bench.llm import pass_units_speedup

    def p(g, accepted, draft_s, verify_s):
        return {"g": g, "accepted": accepted, "draft_s": draft_s, "verify_s": verify_s}

    # Never drafted: exactly plain decoding, whatever the machine did in this run.
    assert pass_units_speedup([p(0, 0, 0.0, 0.2), p(0, 0, 0.0, 0.25), p(0, 0, 0.0, 0.3)]) == pytest.approx(1.0)
    # One pass of 3 drafts, 2 kept, costing 1.2 plain passes: 3 tokens in 1.2 + 2 passes for 5 tokens.
    trace = [p(0, 0, 0.0, 0.1), p(3, 2, 0.0, 0.12), p(0, 0, 0.0, 0.1)]
    assert pass_units_speedup(trace) == pytest.approx(5 / 3.2)
    # A pass whose drafts all failed and cost two plain passes: slower than plain.
    assert pass_units_speedup([p(0, 0, 0.0, 0.1), p(4, 0, 0.05, 0.15)]) == pytest.approx(2 / 3)
    assert pass_units_speedup([p(2, 2, 0.0, 0.1)]) is None  # no plain pass in the run to measure one with
