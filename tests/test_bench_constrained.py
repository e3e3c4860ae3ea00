"""`specvoice bench constrained` on a tiny model: every mode side by side, exact, the JSON it documents."""

import json

import torch

from demo.cli import main


def test_bench_constrained_reports_modes_exactness_and_mask_costs(tiny_models, tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(
        'base = "default"\n[llm]\n'
        f'target = "{tiny_models["target"]}"\n'
        'draft = ""\ndevice = "cpu"\ndtype = "float32"\nmax_gamma = 4\n'
        # A short business: the tiny model's context is 1024 byte-level tokens.
        '[business]\nname = "Riverside Dental"\nrole = "receptionist"\ngreeting = "Riverside Dental, hello."\n'
        'open_slots = ["Tuesday 10:30 a.m. with Dr. Patel", "Friday 9:00 a.m. with Dr. Patel"]\n'
    )
    out = tmp_path / "constrained.json"
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", "constrained", "--config", str(config), "--tasks", "2", "--max-new-tokens", "40",
                   "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert set(summary) == {f"tool_call/{m}" for m in ("call_drafter", "constrained_plain", "constrained_spec",
                                                         "constrained_spec_call")} | {
        f"extract/{m}" for m in ("constrained_plain", "constrained_spec")}
    # Speculation under the constraint changes no token.
    assert report["exact_vs_constrained_plain"] == {"constrained_spec": "4/4", "constrained_spec_call": "2/2"}
    for key, entry in summary.items():
        assert entry["tokens_per_pass"] >= 1.0
        if not key.endswith("call_drafter"):
            assert 0.0 < entry["forced_share"] <= 1.0  # keys, quotes and separators are forced
            assert entry["mask_ms_per_pass_median"] > 0
    # The forced tokens are drafted: fewer passes than tokens with speculation. Without it,
    # one token a pass after the forced opening (which the prefill computes with the prompt).
    assert summary["extract/constrained_spec"]["tokens_per_pass"] > summary["extract/constrained_plain"]["tokens_per_pass"]
    plain = [r for r in report["runs"] if r["mode"] == "constrained_plain"]
    assert plain and all(r["passes"] == r["tokens"] - r["opening"] for r in plain), plain
    lib = report["libraries"]["llguidance"]
    assert lib["compile_ms_median"] > 0 and lib["mask_ms_median"] > 0 and lib["masks"] > 0
    assert "xgrammar" in report["libraries"]  # measured, or says how to install it
    assert all(r["kind"] in ("tool_call", "extract") and "text" in r for r in report["runs"])
