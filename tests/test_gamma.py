"""Adaptive gamma picks the throughput-maximising number of drafts, 0 included."""

import pytest

from llm.gamma import CostModel, GammaController, expected_tokens


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 5) == pytest.approx(1.0)
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)
    assert expected_tokens(1.0, 3) == 4.0


def controller(step=0.1, per_row=0.002, max_gamma=8):
    """A controller that has measured wide passes already (past the slow start)."""
    return GammaController(max_gamma=max_gamma, verify=CostModel(step_s=step, per_extra_row_s=per_row, wide_seen=5))


def test_free_accurate_drafts_use_full_gamma():
    c = controller()
    s = c.stats("ngram4")
    s.accepted, s.rejected, s.cost_per_token = 95.0, 5.0, 0.0
    assert c.choose("ngram4", 8) == 8
    assert c.choose("ngram4", 3) == 3  # never more than offered


def test_costly_inaccurate_drafts_turn_speculation_off():
    c = controller()
    s = c.stats("model")
    s.accepted, s.rejected, s.cost_per_token = 1.0, 9.0, 0.05
    assert c.choose("model", 8) == 0


def test_choice_matches_brute_force_rate():
    c = controller(step=0.09, per_row=0.007)
    s = c.stats("model")
    s.accepted, s.rejected, s.cost_per_token = 8.0, 2.0, 0.04
    a = s.acceptance
    rates = {g: expected_tokens(a, g) / (g * 0.04 + 0.09 + 0.007 * g) for g in range(1, 9)}
    rates[0] = 1 / 0.09
    assert c.choose("model", 8) == max(rates, key=rates.get)


def test_one_slow_verify_does_not_switch_speculation_off():
    c = controller()
    s = c.stats("ngram3")
    s.accepted, s.rejected = 6.0, 4.0
    g_before = c.choose("ngram3", 8)
    assert g_before > 0
    c.observe_verify(g_before + 1, 5.0)  # the machine stalled for 5 s once
    assert c.choose("ngram3", 8) > 0


def test_costs_follow_a_real_change():
    m = CostModel(step_s=0.1, per_extra_row_s=0.0)
    for _ in range(40):
        m.observe(1, 0.2)
        m.observe(5, 0.3)
    assert m.cost(1) == pytest.approx(0.2, rel=0.05)
    assert m.cost(5) == pytest.approx(0.3, rel=0.05)


def test_acceptance_is_learnt_from_passes():
    c = controller()
    for _ in range(30):
        c.observe_draft("model", 4, 4, 0.1)
    assert c.stats("model").acceptance > 0.9
    for _ in range(30):
        c.observe_draft("model", 4, 0, 0.1)
    assert c.stats("model").acceptance < 0.2


def test_idle_source_is_explored_now_and_then():
    c = controller()
    s = c.stats("model")
    s.accepted, s.rejected, s.cost_per_token = 0.1, 10.0, 0.2
    picks = [c.choose("model", 8) for _ in range(c.explore_every)]
    assert picks[:-1] == [0] * (c.explore_every - 1)
    assert picks[-1] == 1


def test_fixed_gamma_is_respected():
    c = GammaController(max_gamma=5, fixed=5)
    assert c.choose("model", 8) == 5
    assert c.choose("ngram2", 2) == 2


def test_slow_start_before_wide_passes_are_measured():
    """A cost line fitted to one-row passes is not trusted for nine rows: one draft until a
    two-row pass was measured, then twice as wide with each wide pass measured."""
    c = GammaController(max_gamma=8, verify=CostModel(step_s=0.1, per_extra_row_s=0.002))
    s = c.stats("ngram4")
    s.accepted, s.rejected = 95.0, 5.0
    assert c.choose("ngram4", 8) == 1
    c.observe_verify(2, 0.102)
    assert c.choose("ngram4", 8) == 3
    c.observe_verify(4, 0.106)
    assert c.choose("ngram4", 8) == 7
    c.observe_verify(8, 0.114)
    assert c.choose("ngram4", 8) == 8


def test_margin_keeps_a_marginal_gain_off():
    """Speculation that the estimate says gains 5% is not worth its risk: the margin is 10%."""
    c = controller(step=0.1, per_row=0.0)
    s = c.stats("ngram2")
    s.accepted, s.rejected, s.cost_per_token = 0.05, 0.95, 0.0  # a = 0.05: E(1) = 1.05 tokens for the same cost
    assert c.choose("ngram2", 1) == 0
    c.margin = 0.0
    assert c.choose("ngram2", 1) == 1
