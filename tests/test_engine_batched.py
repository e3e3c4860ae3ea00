"""Batched passes across calls (issue 14): one engine thread runs the rows of every active
conversation as one target forward, and each call's tokens are exactly those it gets alone.

Overlap is forced, not hoped for: the engines here wait (gather_s) until every active
conversation has submitted its next pass, and the tests assert that passes really carried
the rows of several conversations. Conversations join mid-stream (started from another
conversation's stream) and one is cancelled mid-way.
"""

import threading

import pytest
import torch

from llm.engine import SpeculativeEngine
from llm.gamma import CostModel, GammaController, Load, expected_tokens
from llm.model import Segment, forward, forward_many, new_cache
from llm.types import SamplingParams

PROMPTS = [
    "A cleaning costs $89, a check-up $59. Dr. Patel has a slot on Tuesday at 10:30 a.m. A cleaning costs",
    "Hello! How can I help you today? Café, naïve, jalapeño — 日本語. Hello! How can",
    "Riverside Dental is open Monday to Friday from 8 a.m. to 6 p.m. and Saturday 9 to 1. Riverside",
    "Your order #4521 shipped yesterday and arrives on Thursday.",
]
MAX_NEW = [30, 22, 26, 40]
CANCEL_AT = 4  # conversation 3 is cancelled after this many groups


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


def load(path, draft=None, drafter="none", gamma=0, dtype="int8", **kw):
    eng = SpeculativeEngine.load(path, draft, drafter=drafter, gamma=gamma, dtype=dtype, calibrate=False, **kw)
    return eng


def params_for(i, sampled):
    if sampled:
        return SamplingParams(max_new_tokens=MAX_NEW[i], temperature=0.9, top_k=40, seed=100 + i)
    return SamplingParams(max_new_tokens=MAX_NEW[i])


def alone(eng, i, sampled, cancel_at=None):
    """Conversation i on the engine with nothing else running: its groups' token ids."""
    cancel = threading.Event()
    ids = []
    for n, g in enumerate(eng.stream(eng.encode(PROMPTS[i]), params_for(i, sampled), cancel=cancel), 1):
        ids.extend(g.token_ids)
        if cancel_at is not None and n == cancel_at:
            cancel.set()
    return ids


def together(eng, sampled):
    """Conversations 0 and 1 start together; 2 joins when 0 has streamed 3 groups, 3 joins
    when 1 has streamed 2, and 3 is cancelled after CANCEL_AT groups. Returns each one's
    token ids and finish reasons."""
    out = {i: [] for i in range(4)}
    reasons = {}
    errors = []
    threads: dict[int, threading.Thread] = {}
    cancel3 = threading.Event()
    start_both = threading.Barrier(2)

    def start(i):
        threads[i] = threading.Thread(target=convo, args=(i,), name=f"conv{i}")
        threads[i].start()

    def convo(i):
        try:
            if i in (0, 1):
                start_both.wait(10)
            cancel = cancel3 if i == 3 else None
            for n, g in enumerate(eng.stream(eng.encode(PROMPTS[i]), params_for(i, sampled), cancel=cancel), 1):
                out[i].extend(g.token_ids)
                reasons[i] = g.finish_reason
                if i == 0 and n == 3:
                    start(2)
                if i == 1 and n == 2:
                    start(3)
                if i == 3 and n == CANCEL_AT:
                    cancel3.set()
        except BaseException as e:  # noqa: BLE001
            errors.append((i, e))

    start(0)
    start(1)
    for i in range(4):
        while i not in threads:  # 2 and 3 are started by 0 and 1
            threads[0].join(0.05)
        threads[i].join(60)
    assert not errors, errors
    return out, reasons


CASES = [
    # (model, dtype, drafter, gamma, draft)
    ("target", "int8", "none", 0, None),
    ("target", "int8", "ngram", 3, None),
    ("target", "int8", "model", 2, "target"),  # a draft equal to the target: long accepted runs
    ("target", "int8", "hybrid", "auto", "draft"),
    ("llama", "int8", "ngram", 4, None),
    ("target", "float32", "model", 3, "draft"),
    ("llama", "float32", "ngram", 2, None),
]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:4])))
def test_concurrent_conversations_equal_each_alone(tiny_models, case, sampled):
    name, dtype, drafter, gamma, draft = case
    if sampled and gamma == "auto":
        pytest.skip("adaptive gamma changes how many random draws a pass takes: sampled runs compare at a fixed gamma")
    eng = load(tiny_models[name], tiny_models[draft] if draft else None, drafter, gamma, dtype, gather_s=20.0)
    solo = {i: alone(eng, i, sampled, CANCEL_AT if i == 3 else None) for i in range(4)}
    before = eng.scheduler.batched_passes
    got, reasons = together(eng, sampled)
    for i in range(3):
        assert got[i] == solo[i], f"conversation {i} differs from its run alone"
        assert reasons[i] in ("length", "eos")
    # The cancelled one: what it produced before the cancel is what it produces alone.
    assert reasons[3] == "cancelled"
    assert got[3] == solo[3][: len(got[3])] and len(got[3]) > 0
    sched = eng.scheduler
    assert sched.batched_passes - before >= 3, "the conversations never shared a target pass"
    assert sched.max_conversations >= 3
    if drafter == "model":  # every pass drafts with the model: their steps share forwards too
        assert sched.batched_draft_passes >= 3, "the draft model's steps were never batched"
    eng.close()


def test_every_pass_runs_on_the_engine_thread(tiny_models):
    eng = load(tiny_models["target"], tiny_models["draft"], "hybrid", 3, gather_s=20.0)
    seen = set()
    hooks = [m.register_forward_pre_hook(lambda *_: seen.add(threading.current_thread().name))
             for m in (eng.target.model.lm_head, eng.draft.model.lm_head)]
    try:
        together(eng, sampled=False)
    finally:
        for h in hooks:
            h.remove()
    assert seen == {"specvoice-engine"}


@pytest.mark.parametrize("dtype", ["int8", "float32"])
@pytest.mark.parametrize("name", ["target", "llama", "target2"])
def test_forward_many_is_bitwise_each_forward_alone(tiny_models, name, dtype):
    """The batched forward (a prefill, a verify, a decode, a verify far along) gives each
    segment bitwise the logits and K/V of `forward` on its own."""
    model = load(tiny_models[name], dtype=dtype).target.model
    gen = torch.Generator().manual_seed(0)
    shapes = [(0, 23, False), (40, 5, True), (17, 1, True), (60, 9, True)]  # (start, rows, all_logits)
    history = [torch.randint(0, model.args.vocab_size, (start,), generator=gen) for start, _, _ in shapes]
    rows = [torch.randint(0, model.args.vocab_size, (t,), generator=gen) for _, t, _ in shapes]

    def fresh(i):
        cache = new_cache(model, 8)
        if shapes[i][0]:
            forward(model, cache, history[i], 0)
        return cache

    with torch.inference_mode():
        solo = []
        for i, (start, _, all_logits) in enumerate(shapes):
            cache = fresh(i)
            solo.append((forward(model, cache, rows[i], start, all_logits), cache))
        caches = [fresh(i) for i in range(len(shapes))]
        batched = forward_many(model, [Segment(caches[i], rows[i], s, a) for i, (s, _, a) in enumerate(shapes)])
    for i, (start, t, _) in enumerate(shapes):
        logits, cache = solo[i]
        assert torch.equal(batched[i], logits), f"segment {i}: max diff {(batched[i] - logits).abs().max()}"
        assert caches[i].length == cache.length == start + t
        for layer in range(model.args.num_layers):
            assert torch.equal(caches[i].keys[layer][:, : start + t], cache.keys[layer][:, : start + t])
            assert torch.equal(caches[i].values[layer][:, : start + t], cache.values[layer][:, : start + t])


def beside_a_broken_one(eng, bad) -> dict:
    """Conversation 0 and, started together, conversation 2 on `bad` (whose drafter raises):
    {"good": conversation 0's token ids, "error": the message conversation 2 raised}."""
    both = threading.Barrier(2)
    result = {}

    def good():
        both.wait(10)
        result["good"] = [t for g in eng.stream(eng.encode(PROMPTS[0]), params_for(0, False)) for t in g.token_ids]

    def broken():
        both.wait(10)
        try:
            list(eng.stream(eng.encode(PROMPTS[2]), params_for(2, False), bad))
        except RuntimeError as e:
            result["error"] = str(e)

    threads = [threading.Thread(target=good), threading.Thread(target=broken)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return result


def test_a_failing_conversation_does_not_disturb_the_others(tiny_models):
    """A drafter that raises in one conversation: that call gets the error, the pass of
    the others still runs and their tokens are unchanged."""
    eng = load(tiny_models["target"], None, "ngram", 3, gather_s=20.0)
    solo = alone(eng, 0, False)

    class Broken:
        name = "ngram"

        def propose(self, context, k, params):
            raise RuntimeError("drafter broke")

        def accepted(self, n):
            pass

    bad = eng.new_conversation()
    bad.drafters = [Broken()]
    result = beside_a_broken_one(eng, bad)
    assert result["error"] == "drafter broke"
    assert result["good"] == solo


def test_a_draft_model_failing_mid_draft_does_not_disturb_the_others(tiny_models):
    """A draft model that raises after its first batched step: that conversation gets the
    error; the other, drafting with the real draft model in the same rounds, is unchanged."""
    eng = load(tiny_models["target"], tiny_models["draft"], "model", 3, gather_s=20.0)
    solo = alone(eng, 0, False)
    bad = eng.new_conversation()
    real = bad.drafters[0]

    class BreaksAfterOneStep:
        name = "model"

        def propose_steps(self, context, k, params):
            yield next(real.propose_steps(context, k, params))  # its first step runs, batched
            raise RuntimeError("draft model broke")

        def propose(self, context, k, params):
            raise AssertionError("the engine thread drives propose_steps")

        def accepted(self, n):
            pass

    bad.drafters = [BreaksAfterOneStep()]
    result = beside_a_broken_one(eng, bad)
    assert result["error"] == "draft model broke"
    assert result["good"] == solo


def test_fixed_width_conversations_run_alone_and_stay_exact(tiny_models):
    """The fixed-width path (CUDA's, here eager on CPU) is not batched across calls: each
    conversation's step runs alone on the engine thread, and stays exact."""
    eng = load(tiny_models["target"], None, "ngram", 3, "float32", fixed_width=True, gather_s=20.0)
    solo = {i: alone(eng, i, False, CANCEL_AT if i == 3 else None) for i in range(4)}
    got, reasons = together(eng, sampled=False)
    for i in range(3):
        assert got[i] == solo[i]
    assert got[3] == solo[3][: len(got[3])] and reasons[3] == "cancelled"
    assert eng.scheduler.batched_passes == 0 and eng.scheduler.rounds > eng.scheduler.passes / 2


def test_unbatched_engine_thread_is_exact_too(tiny_models):
    eng = load(tiny_models["target"], None, "ngram", 2, batched=False, gather_s=20.0)
    solo = {i: alone(eng, i, False, CANCEL_AT if i == 3 else None) for i in range(4)}
    got, _ = together(eng, sampled=False)
    assert all(got[i] == solo[i] for i in range(3))
    assert eng.scheduler.batched_passes == 0


# ---- gamma under load ----------------------------------------------------------------------


def controller(step=0.1, per_row=0.01):
    """A controller past its slow start (it has measured wide passes), with no margin: the
    rule under test is the aggregate maximum (the margin is tests/test_gamma.py's)."""
    c = GammaController(max_gamma=8, verify=CostModel(step_s=step, per_extra_row_s=per_row, wide_seen=12), margin=0.0)
    s = c.stats("ngram3")
    s.accepted, s.rejected, s.cost_per_token = 1.0, 1.0, 0.0  # acceptance 0.5, free drafts
    return c


def aggregate(c, g, load):
    """Tokens per second of the whole pass if this conversation verifies g drafts."""
    a = c.stats("ngram3").acceptance
    e = expected_tokens(a, g) if g else 1.0
    return (e + load.tokens) / (load.draft_s + c.verify.cost(load.rows + g + 1))


def test_no_load_is_the_single_conversation_rule():
    c = controller()
    alone_rates = {g: expected_tokens(0.5, g) / c.verify.cost(g + 1) for g in range(1, 9)}
    alone_rates[0] = 1 / c.verify.cost(1)
    assert c.choose("ngram3", 8) == max(alone_rates, key=alone_rates.get) > 0


def test_a_heavy_batch_turns_speculation_off():
    """Rows cost 10% of a step each: alone, drafts pay; beside 30 other rows bringing
    about one token each, every extra row slows 31 conversations and speculation stops."""
    c = controller()
    assert c.choose("ngram3", 8) > 0
    c.load = Load(rows=30, tokens=30.0)
    assert c.choose("ngram3", 8) == 0


@pytest.mark.parametrize("rows", [0, 1, 3, 8, 20, 60])
@pytest.mark.parametrize("per_row", [0.0005, 0.003, 0.01, 0.05])
def test_chosen_gamma_never_slows_the_batch_below_gamma0(rows, per_row):
    c = controller(per_row=per_row)
    load = Load(rows=rows, tokens=float(rows), draft_s=0.0)
    c.load = load
    g = c.choose("ngram3", 8)
    assert aggregate(c, g, load) >= aggregate(c, 0, load)
    assert aggregate(c, g, load) == pytest.approx(max(aggregate(c, k, load) for k in range(9)))



def test_a_job_runs_on_the_engine_thread_and_returns_its_value():
    """scheduler.call (a prefix's prefill): the value or the error comes back to the caller."""
    from llm.scheduler import PassScheduler

    sched = PassScheduler()
    try:
        assert sched.call(lambda: threading.current_thread().name) == "specvoice-engine"

        def broken():
            raise ValueError("no prefix")

        with pytest.raises(ValueError, match="no prefix"):
            sched.call(broken)
        assert sched.call(lambda: 7) == 7  # the thread survives a failed job
    finally:
        sched.close()


def _submit(sched, name: str, order: list, **kw) -> threading.Thread:
    """A pass with no target rows (it ends at its prepare), submitted from its own thread as
    a conversation's is: `order` gets (name, the round it ran in), or (name, "skipped")."""
    from llm.scheduler import PassSkipped

    def go():
        try:
            sched.run(lambda load: order.append((name, sched.rounds)), None, **kw)
        except PassSkipped:
            order.append((name, "skipped"))

    t = threading.Thread(target=go)
    t.start()
    return t


def _taken_by_the_engine(sched) -> None:
    """The first pass was submitted and the engine thread took it (the queue is empty
    again): it waits for the pass lock the test holds."""
    with sched._cond:
        assert sched._cond.wait_for(lambda: not sched._queue and sched._thread is not None, 30)


def test_an_ended_turns_pass_goes_before_preemptive_ones_and_never_shares_their_round():
    """Priority by event, no timing: while the engine thread holds a preemptive (background)
    pass behind the lock, another preemptive pass and an ended turn's pass arrive; when
    the lock opens, the ended turn's pass runs in a round of its own, and the two
    preemptive ones after it, together."""
    from llm.scheduler import PassScheduler

    lock = threading.Lock()
    sched = PassScheduler(lock, gather_s=0.0)
    order: list[tuple[str, int]] = []

    lock.acquire()
    try:
        threads = [_submit(sched, "preempt-a", order, background=True)]
        _taken_by_the_engine(sched)
        threads += [_submit(sched, "preempt-b", order, background=True),
                    _submit(sched, "ended-turn", order, background=False)]
        assert sched.wait_until_waiting(2)
    finally:
        lock.release()
    for t in threads:
        t.join(30)
    try:
        assert [name for name, _ in order][0] == "ended-turn"
        rounds = {name: r for name, r in order}
        assert rounds["preempt-a"] == rounds["preempt-b"] > rounds["ended-turn"]
        assert sched.deferred == 2
    finally:
        sched.close()


def test_a_queued_preemptive_pass_whose_turn_ends_goes_with_the_next_round():
    """A preemptive pass waits in the queue behind other calls' answers; its turn ends (its
    flag turns) before the engine chooses the next round: it runs in that round, not after
    every foreground pass that keeps coming (a kept answer's prefill waited 5.8 s so in
    `bench load` at 4 calls). With the flag read only at submission it would be deferred."""
    from llm.scheduler import PassScheduler

    lock = threading.Lock()
    sched = PassScheduler(lock, gather_s=0.0)
    order: list[tuple[str, int]] = []
    still_preemptive = [True]

    lock.acquire()
    try:
        threads = [_submit(sched, "other-call-a", order)]
        _taken_by_the_engine(sched)
        threads += [_submit(sched, "kept-answer", order, background=lambda: still_preemptive[0]),
                    _submit(sched, "other-call-b", order)]
        assert sched.wait_until_waiting(2)
        still_preemptive[0] = False  # the turn ended on the preempted audio
    finally:
        lock.release()
    for t in threads:
        t.join(30)
    try:
        rounds = {name: r for name, r in order}
        assert rounds["kept-answer"] == rounds["other-call-a"] == rounds["other-call-b"]
        assert sched.deferred == 0
    finally:
        sched.close()


def test_a_pass_whose_generation_is_cancelled_while_it_waits_is_not_run():
    """A queued pass is skipped, unrun, once its `skip` reads true (its generation was
    cancelled while it waited: a speech prefill a pause's start stopped); its caller gets
    PassSkipped and the pass beside it runs as usual."""
    from llm.scheduler import PassScheduler

    lock = threading.Lock()
    sched = PassScheduler(lock, gather_s=0.0)
    order: list[tuple[str, int | str]] = []
    cancelled = threading.Event()

    lock.acquire()
    try:
        threads = [_submit(sched, "answer", order)]
        _taken_by_the_engine(sched)
        threads.append(_submit(sched, "speech-prefill", order, background=True, skip=cancelled.is_set))
        assert sched.wait_until_waiting(1)
        cancelled.set()  # a pause's start stopped the prefill
    finally:
        lock.release()
    for t in threads:
        t.join(30)
    try:
        assert len(order) == 2  # one entry each: the skipped pass's prepare never ran
        outcome = {name: "skipped" if r == "skipped" else "ran" for name, r in order}
        assert outcome == {"answer": "ran", "speech-prefill": "skipped"}
        assert sched.skipped == 1 and sched.deferred == 0
    finally:
        sched.close()


def test_a_generation_cancelled_while_its_prefill_waits_ends_with_nothing_cached(tiny_models):
    """The engine is busy (its pass lock held) while a conversation's prefill waits; the
    generation is cancelled: the pass is not run, the stream ends as cancelled with no
    token, the conversation's cache holds nothing of it, and its next generation is token
    for token a fresh conversation's."""
    eng = load(tiny_models["target"], None, "ngram", 3)
    try:
        conv, cancel, groups = eng.new_conversation(), threading.Event(), []
        prompt, params = eng.encode(PROMPTS[0]), SamplingParams(max_new_tokens=12)
        sched = eng.scheduler
        with sched.lock:  # the engine is busy
            t = threading.Thread(target=lambda: groups.extend(eng.stream(prompt, params, conv, cancel)))
            t.start()
            _taken_by_the_engine(sched)
            cancel.set()
        t.join(30)
        assert [(g.token_ids, g.finish_reason) for g in groups] == [((), "cancelled")]
        assert sched.skipped == 1 and conv.seq.tokens == []
        again = [tok for g in eng.stream(prompt, params, conv) for tok in g.token_ids]
        fresh = [tok for g in eng.stream(prompt, params, eng.new_conversation()) for tok in g.token_ids]
        assert again == fresh and again
    finally:
        eng.close()


def test_an_ended_turns_pass_that_comes_during_a_background_round_is_counted_as_waiting_for_it():
    """A forward is not interrupted: an ended turn's pass that arrives while a round of
    preemptive passes alone runs waits for it, and the scheduler counts that wait (what
    `bench load` reports). One that arrives during a foreground round is not counted."""
    from llm.scheduler import PassScheduler

    sched = PassScheduler(gather_s=0.0)
    entered, go = threading.Event(), threading.Event()

    def held(load):  # a pass that is running: the engine thread is inside it
        entered.set()
        go.wait(30)

    def run(background: bool, prepare=lambda load: None) -> threading.Thread:
        t = threading.Thread(target=sched.run, args=(prepare, None), kwargs={"background": background})
        t.start()
        return t

    try:
        for background, counted in ((False, 0), (True, 1)):
            entered.clear(), go.clear()
            first = run(background, held)
            assert entered.wait(30)
            second = run(False)
            assert sched.wait_until_waiting(1)
            go.set()
            first.join(30), second.join(30)
            assert sched.behind_background == counted
        assert sched.behind_background_s > 0
    finally:
        go.set()
        sched.close()


def test_background_passes_alone_run_at_once():
    """With nothing else waiting, a preemptive pass is not held back."""
    from llm.scheduler import PassScheduler

    sched = PassScheduler(gather_s=0.0)
    try:
        ran = []
        sched.run(lambda load: ran.append("preempt"), None, background=True)
        assert ran == ["preempt"] and sched.deferred == 0
    finally:
        sched.close()
