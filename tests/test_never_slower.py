"""Speculation never slower than plain decoding (issue 27), with the machine's costs injected.

The controller learns costs from the seconds the runner reports and the clock the decoder
reads; here both come from a made-up machine (a timer that runs the real forward, so the
tokens are real, and reports the seconds that machine would take). No sleeps, no
dependence on this machine's speed. On a machine where drafting does not pay the
controller must settle at gamma 0 within a few passes and stay exact; where it pays, it
must speculate.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from llm.cuda_graphs import timed_forward
from llm.decoder import Generation, new_sequence, speculative_stream
from llm.detokenize import IncrementalDetokenizer
from llm.drafters import ModelDrafter, NgramDrafter
from llm.engine import SpeculativeEngine
from llm.gamma import CostModel, GammaController
from llm.scheduler import SoloRunner
from llm.types import GenerationStats, SamplingParams

PROMPT = ("A cleaning costs $89, a check-up $59. Dr. Patel has a slot on Tuesday at 10:30 a.m. "
          "A cleaning costs $89, a check-up $59. Dr. Patel has a slot on Tuesday at")
PROMPT_2 = ("Riverside Dental is open Monday to Friday from 8 a.m. to 6 p.m. and Saturday 9 to 1. "
            "Riverside Dental is open Monday to Friday from 8 a.m. to")
MAX_NEW = 64


@dataclass
class Machine:
    """A made-up machine: a target step, what each extra verify row adds (a share of a
    step), and a draft model's step; `now` is its clock."""

    step_s: float
    extra_row: float
    draft_step_s: float
    target: object = None
    now: float = 0.0

    def clock(self) -> float:
        return self.now

    def timer(self, model, segments):
        logits, _ = timed_forward(model, segments)  # the real forward: real tokens
        rows = sum(int(s.tokens.shape[0]) for s in segments)
        if model is self.target:
            seconds = self.step_s * (1 + self.extra_row * (rows - 1))
        else:
            seconds = self.draft_step_s * (1 + 0.1 * (rows - 1))
        self.now += seconds
        return logits, seconds


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


def optimistic_controller() -> GammaController:
    """Estimates calibrated on a quiet moment: cheap verifies, a cheap draft model, a cheap
    catch-up (what `SpeculativeEngine.calibrate` would seed on another day)."""
    c = GammaController(max_gamma=8, verify=CostModel(step_s=0.1, per_extra_row_s=0.003, wide_seen=1))
    c.stats("model").cost_per_token = 0.005
    c.stats("model").catch_up_row_s = 0.002
    return c


def decode(eng, machine: Machine, drafters, controller, prompt):
    machine.target = eng.target.model
    stats = GenerationStats()
    # No end token: every run writes MAX_NEW tokens, so the passes compare like for like.
    gen = Generation(SamplingParams(max_new_tokens=MAX_NEW), frozenset(), 1024, runner=SoloRunner(timer=machine.timer))
    detok = IncrementalDetokenizer(eng.target.tokenizer)
    start = machine.now
    with torch.inference_mode():
        ids = [t for g in speculative_stream(eng.target.model, new_sequence(eng.target.model), prompt, drafters,
                                             controller, detok, gen, stats, clock=machine.clock) for t in g.token_ids]
    return ids, stats, machine.now - start - stats.prefill_s  # decoding: after the prompt's prefill


def model_drafter(eng, draft):
    d = ModelDrafter(draft.model, eng.target.model.args.vocab_size)
    d.step_s = 0.005  # as the engine seeds it from its calibration
    return d


@dataclass
class Oracle:
    """A free drafter that knows the answer (the target's own output): drafting costs
    nothing and every draft is right, so speculation pays wherever verifies are cheap."""

    answer: list[int]
    prompt_len: int
    name: str = "ngram"

    def propose(self, context, k, params):
        from llm.drafters import Proposal

        done = len(context) - self.prompt_len
        return Proposal(self.answer[done : done + k], None, "ngram4", 0.0)

    def accepted(self, n):
        pass


MACHINES = {
    # verifies are cheap, but a draft step costs 80% of a target step
    "slow_draft_model": (Machine(0.1, 0.05, 0.08), lambda eng: [model_drafter(eng, eng.draft)]),
    # every extra verify row costs a whole step (n-gram drafts cannot pay)
    "expensive_verify_ngram": (Machine(0.1, 1.0, 0.0), lambda eng: [NgramDrafter(min_n=1)]),
    "expensive_verify_hybrid": (Machine(0.1, 1.0, 0.08), lambda eng: [NgramDrafter(min_n=1), model_drafter(eng, eng.draft)]),
}


@pytest.mark.parametrize("case", list(MACHINES))
def test_where_drafting_does_not_pay_the_controller_settles_at_gamma_0(tiny_models, case):
    """Two turns on one engine's estimates (its controller outlives a turn). The first
    turn learns the machine in a few passes; the second starts from what it learnt."""
    eng = SpeculativeEngine.load(tiny_models["target"], tiny_models["draft"], drafter="hybrid", gamma="auto",
                                 dtype="float32", calibrate=False)
    machine, make_drafters = MACHINES[case]
    controller = optimistic_controller()
    spent = plain_spent = 0.0
    for turn, text in enumerate((PROMPT, PROMPT_2)):
        prompt = eng.encode(text)
        plain_machine = Machine(machine.step_s, machine.extra_row, machine.draft_step_s)
        plain, _, plain_s = decode(eng, plain_machine, [], optimistic_controller(), prompt)
        ids, stats, decode_s = decode(eng, machine, make_drafters(eng), controller, prompt)
        assert ids == plain, "the controller changed the output"
        spent, plain_spent = spent + decode_s, plain_spent + plain_s
        if turn == 0:
            settled = stats.gammas[6:]
            assert len(settled) > 20
            # Each source (ngram1u, ngram1m, ngram2, ..., model) is tried once before its
            # acceptance is known; beyond those first tries, at most two passes speculate.
            tried, again = set(), 0
            for record in stats.trace:
                if record["g"] > 0:
                    again += record["source"] in tried
                    tried.add(record["source"])
            assert again <= 2, f"still speculating after the first passes: {stats.trace}"
            assert sum(g > 0 for g in settled) <= len(tried) + 2, stats.gammas
        else:  # settled: at most a probe, and as fast as plain decoding
            assert sum(g > 0 for g in stats.gammas) <= 2, stats.gammas
            assert decode_s <= 1.05 * plain_s, f"turn 2: {decode_s:.2f} s against {plain_s:.2f} s plain"
    # Both turns, learning included, at most 15% over plain decoding.
    assert spent <= 1.15 * plain_spent, f"{spent:.2f} s against {plain_spent:.2f} s plain"
    # The per-pass record says why: the measured verify cost caught up with the real one.
    assert stats.trace[-1]["estimated_verify_s"] == pytest.approx(machine.step_s, rel=0.2)


@pytest.mark.parametrize("case", ["model_equal_to_target", "free_oracle_cheap_verify"])
def test_where_drafting_pays_the_controller_speculates(tiny_models, case):
    eng = SpeculativeEngine.load(tiny_models["target"], tiny_models["target"], drafter="model", gamma="auto",
                                 dtype="float32", calibrate=False)
    prompt = eng.encode(PROMPT)
    plain, _, plain_s = decode(eng, Machine(0.1, 0.02, 0.005), [], optimistic_controller(), prompt)
    machine = Machine(0.1, 0.02, 0.005)
    if case == "model_equal_to_target":  # every draft accepted, drafting nearly free
        drafters = [model_drafter(eng, eng.draft)]
    else:
        drafters = [Oracle(plain, len(prompt))]
    ids, stats, spent = decode(eng, machine, drafters, optimistic_controller(), prompt)
    assert ids == plain
    assert sum(stats.gammas) / len(stats.gammas) > 1.0, stats.gammas
    assert stats.passes < len(ids)
    assert spent < plain_s


def test_a_draft_model_far_behind_is_charged_its_catch_up(tiny_models):
    """A new turn's prompt the draft model has not read costs it a catch-up: the controller
    does not draft with it while that catch-up outweighs what it would win."""
    eng = SpeculativeEngine.load(tiny_models["target"], tiny_models["target"], drafter="model", gamma="auto",
                                 dtype="float32", calibrate=False)
    prompt = eng.encode(PROMPT)
    d = model_drafter(eng, eng.draft)
    assert d.behind(prompt) == len(prompt)
    c = optimistic_controller()
    c.verify.wide_seen = 5
    c.stats("model").accepted, c.stats("model").rejected = 9.0, 1.0
    c.stats("model").catch_up_row_s = 0.05  # a catch-up row costs half a target step
    extra = c.catch_up_s("model", d.behind(prompt) - 1)
    assert extra == pytest.approx((len(prompt) - 1) * 0.05)
    assert c.choose("model", 8, extra) == 0
    assert c.choose("model", 8, 0.0) > 0  # caught up, the same drafter pays
    c.observe_catch_up("model", 100, 0.2)  # measured: 2 ms a row, far cheaper
    assert c.stats("model").catch_up_row_s < 0.05


def test_estimates_outlive_the_conversation(tiny_models):
    """What one conversation learns is the engine's: the next conversation starts from it."""
    eng = SpeculativeEngine.load(tiny_models["target"], None, drafter="ngram", gamma="auto", dtype="float32",
                                 calibrate=False)
    first = eng.new_conversation()
    eng.generate(eng.encode(PROMPT), SamplingParams(max_new_tokens=24), first)
    second = eng.new_conversation()
    assert second.controller.verify is first.controller.verify
    assert second.controller.sources is first.controller.sources
    assert second.controller.verify.step_s != CostModel().step_s  # learnt from the first one's passes


def test_benched_drafter_comes_back_with_a_probe_and_its_bench_doubles():
    c = optimistic_controller()
    s = c.stats("ngram3")
    s.accepted, s.rejected = 9.0, 1.0
    for _ in range(c.judge_after):  # four passes that each took three plain steps for two tokens
        c.observe_pass("ngram3", 4, 2, 3 * c.verify.cost(1))
    assert s.benched == 16
    picks = [c.choose("ngram3", 4) for _ in range(16)]
    assert picks[:-1] == [0] * 15 and picks[-1] > 0  # benched, then one probe
    for _ in range(c.judge_after):
        c.observe_pass("ngram3", 4, 2, 3 * c.verify.cost(1))
    assert s.benched == 32


def test_the_answer_memorys_offers_are_learnt_when_not_drafted(tiny_models):
    """A machine where no draft pays (each extra row costs a whole step): the controller
    decodes plainly, so nothing is drafted from the answer memory, and yet the memory's
    source learns how its offers fared against the tokens the target wrote. Here the
    memory holds the target's own answer, so its acceptance estimate rises from the prior
    (2/3) to near certainty: the next time rows are cheap enough, it is trusted."""
    from llm.answer_memory import AnswerDrafter, AnswerMemory

    eng = SpeculativeEngine.load(tiny_models["target"], drafter="ngram", gamma=0, dtype="float32", calibrate=False)
    prompt = eng.encode(PROMPT)
    answer, _, _ = decode(eng, Machine(0.1, 1.0, 0.0), [], GammaController(fixed=0), prompt)  # gamma 0
    memory = AnswerMemory(max_answers=4)
    memory.add(prompt, answer)
    # It knows the machine already: a row costs a step, so even certain drafts would not pay.
    # (No probe drafts either: explore_every past the answer's length.)
    controller = GammaController(max_gamma=8, verify=CostModel(step_s=0.1, per_extra_row_s=0.1, wide_seen=4),
                                 explore_every=10 * MAX_NEW)
    ids, stats, _ = decode(eng, Machine(0.1, 1.0, 0.0), [AnswerDrafter(memory)], controller, prompt)
    assert ids == answer  # greedy: the target's own tokens whatever was offered
    assert not any(p["source"].startswith("answers") for p in stats.trace)  # nothing drafted from it
    learnt = {k: s for k, s in controller.sources.items() if k.startswith("answers")}
    assert learnt and all(s.rejected < 0.1 and s.acceptance > 0.95 for s in learnt.values())
