"""`specvoice bench quality`: the normaliser, the rule checker (it must flag the false
answers quoted in the issue and accept correct ones), the question set's schema, and one
end-to-end run on a tiny random model for the JSON fields (not for correctness)."""

import json
import re
from collections import Counter

import pytest
import torch

from bench.quality import (
    CATEGORIES,
    QUESTIONS,
    VARIANTS,
    Rules,
    business_file,
    check,
    load_business,
    load_questions,
    normalize,
    sentences,
    variant_prompts,
)
from demo.cli import main


@pytest.fixture(scope="module")
def questions():
    qs, data = load_questions()
    return {q.id: q for q in qs}, data


def verdict(questions, qid: str, answer: str):
    return check(answer, questions[0][qid].rules)


# ---------------------------------------------------------------- normaliser


@pytest.mark.parametrize("text, expected", [
    ("We open at 9 a.m. See you then.", "we open at 9 am. see you then."),
    ("We open at 9 a.m. on weekdays", "we open at 9 am on weekdays"),
    ("Nine A.M. sharp", "9 am sharp"),
    ("9:00am", "9 am"),
    ("9 o'clock in the morning", "9 am"),
    ("at ten thirty a.m.", "at 10:30 am"),
    ("two fifteen p.m.", "2:15 pm"),
    ("by noon", "by 12 pm"),
    ("6 in the evening", "6 pm"),
    ("It costs eighty-nine dollars.", "it costs $89."),
    ("$89.00 for a cleaning", "$89 for a cleaning"),
    ("thirty-nine dollars and ninety-nine cents", "$39.99"),
    ("$39.99 a month", "$39.99 a month"),
    ("a $1,000 deposit", "a $1000 deposit"),
    ("A check-up, a checkup, two checkups", "a check up, a check up, 2 check ups"),
    ("Dr. Patel’s slot", "dr patel's slot"),
    ("Gluten-free   pasta\n is available", "gluten free pasta is available"),
    ("8 a.m.–6 p.m.", "8 am-6 pm"),
])
def test_normalize_spells_times_money_and_words_one_way(text, expected):
    assert normalize(text) == expected


def test_normalize_leaves_ordinary_words_alone():
    assert normalize("I am here. Someone will call.") == "i am here. someone will call."


def test_sentences_split_after_normalising_but_not_inside_prices_or_titles():
    text = normalize("Dr. Patel is in at 9 a.m. The Basic plan is $39.99 a month! Anything else?")
    assert sentences(text) == ["dr patel is in at 9 am.", "the basic plan is $39.99 a month!", "anything else?"]


# ---------------------------------------------------------------- the checker


def test_phrases_match_whole_words_only():
    rules = Rules.build([["9 a.m."], ["$39"]], [], {})
    assert check("We open at 9 a.m. and it's $39.", rules).correct
    assert not check("We open at 19 a.m. and it's $39.99.", rules).correct


def test_must_not_applies_within_one_sentence():
    rules = Rules.build([], [r"\bopen\b.*\bsunday"], {})
    assert check("We are open Monday to Saturday. We are closed on Sunday.", rules).correct
    assert check("We are open on Sunday.", rules).false_claim


def test_macros_expand_and_an_unknown_macro_is_an_error():
    rules = Rules.build([["re:{{t}}"]], [], {"t": r"\d+ am"})
    assert check("At 9 a.m.", rules).correct
    with pytest.raises(KeyError, match="nope"):
        Rules.build([["re:{{nope}}"]], [], {})


def test_an_empty_answer_is_never_correct():
    assert not check("", Rules.build([], [], {})).correct


def answers(table: str) -> list[tuple[str, str]]:
    """(question id, answer) pairs from the lines "question-id: answer" of a table ("#" lines are comments)."""
    return [tuple(line.split(": ", 1)) for line in table.strip().splitlines() if not line.startswith("#")]


# The false answers quoted in issue 11, each against the question that would draw it.
ISSUE_FALSE = answers("""
dental-close-friday: We close on Friday at 9 a.m.
dental-moreno-price: Dr. Moreno offers a free check-up on Wednesday.
dental-saturday-afternoon: Riverside Dental is open on Saturday afternoon at 3 p.m.
dental-monday: Yes, you can book for Monday.
# The same false claims turn up as asides in answers to other questions: the business's
# shared rules catch them there too.
dental-hours: We close on Friday at 9 a.m.
dental-cleaning-price: A cleaning is $89, and Dr. Moreno offers a free check-up on Wednesday.
dental-address: We're at 42 Harbor Street. Riverside Dental is open on Saturday afternoon at 3 p.m.
dental-slots: We have an opening on Monday at 10 a.m.
""")


@pytest.mark.parametrize("qid, answer", ISSUE_FALSE)
def test_the_issues_false_answers_are_flagged(questions, qid, answer):
    v = verdict(questions, qid, answer)
    assert v.false_claim and not v.correct, v


# Other false answers the default model gave in development runs.
SEEN_FALSE = answers("""
dental-sunday: Yes, I'm open on Sundays.
dental-free-checkup: Yes, that's correct. The price of a check-up is $59.
dental-braces: Yes, Riverside Dental offers braces.
dental-root-canal: The cost of a root canal is $120.
dental-cigna: Yes, Riverside Dental accepts Cigna insurance.
dental-slots: We have a check-up at 8 a.m. on Tuesday, 8 a.m. on Wednesday, and 9 a.m. on Friday.
bistro-hours: Our opening hours are Monday to Sunday, from 5 p.m. to 10 p.m.
bistro-seven: Yes, we have a table for 2 at 7 p.m. tonight.
isp-plus-technician: The visit costs $49.
shop-wednesday: Yes, it's arriving Wednesday.
dental-close-friday: Friday is closed.
dental-saturday: No, Riverside Dental is closed on Saturday.
dental-saturday-afternoon: Yes, we're open Saturday from 9 a.m. to 1 p.m.
bistro-hours: We're closed on Sundays.
shop-store: Yes, we have a physical store in our downtown location.
""")


@pytest.mark.parametrize("qid, answer", SEEN_FALSE)
def test_other_false_answers_are_flagged(questions, qid, answer):
    assert verdict(questions, qid, answer).false_claim


CORRECT = answers("""
dental-close-friday: We close at 6 p.m. on Friday.
dental-close-friday: On Friday we're open from eight a.m. to six p.m.
dental-hours: Our opening hours are Monday to Friday from 8 a.m. to 6 p.m., and Saturday from 9 a.m. to 1 p.m.
dental-moreno-price: A check-up with Dr. Moreno costs $59.
dental-saturday-afternoon: Sorry, on Saturday we close at 1 p.m., so 3 won't work.
dental-monday: Sorry, we have no Monday openings. We have Tuesday at 10:30 a.m., Wednesday at 2:15 p.m. or Friday at 9 a.m.
dental-slots: We have Tuesday at 10:30 a.m. with Dr. Patel, Wednesday at 2:15 p.m. with Dr. Moreno, and Friday at 9:00 a.m. with Dr. Patel.
dental-sunday: No, we're closed on Sundays. We're open Monday to Saturday.
dental-braces: I don't have that information, sorry. I can take a message and have someone call you back.
dental-cigna: We accept Delta Dental and Aetna; I'd need to check about Cigna.
dental-parking: Yes, parking is free behind the building.
bistro-seven: We don't have 7 p.m., but there's a table for 2 at 6:30 p.m.
bistro-twelve: Our tables seat up to 8, but a group of 12 can use the back room, which needs a $100 deposit.
isp-plus-technician: A technician visit is normally $49, but it's waived for Plus customers.
isp-basic-price: The Basic plan is thirty-nine dollars and ninety-nine cents a month.
isp-oak-park: The only outage reported is in Maple Heights.
shop-order-status: Your order 48213 shipped Monday with UPS and arrives Thursday by 8 p.m.
shop-tracking: The tracking number is 1Z999AA10123456784.
shop-free-express: No, express shipping is $14.95; standard shipping is free over $50.
""")


@pytest.mark.parametrize("qid, answer", CORRECT)
def test_correct_answers_are_accepted(questions, qid, answer):
    v = verdict(questions, qid, answer)
    assert v.correct, v


@pytest.mark.parametrize("qid", ["dental-sunday", "bistro-monday", "isp-free-technician", "shop-60-days"])
def test_a_shrug_does_not_correct_a_false_premise(questions, qid):
    """"I'm not sure" to "you're open Sundays, right?" is no false claim, but no answer either."""
    v = verdict(questions, qid, "I'm not sure about that. I can take a message and have someone call you back.")
    assert not v.correct and not v.false_claim


def test_a_missing_fact_is_not_a_false_claim(questions):
    v = verdict(questions, "dental-parking", "Yes, there is parking available.")
    assert not v.correct and not v.false_claim and v.missing == ["free", "behind"]


# ---------------------------------------------------------------- the question set


def test_question_set_schema(questions):
    by_id, data = questions
    raw = data["questions"]
    assert len(raw) >= 60 and len(by_id) == len(raw), "at least 60 questions, unique ids"
    assert sum(q["split"] == "dev" for q in raw) >= 60, "the prompt options were compared on at least 60"
    assert set(data["businesses"]) == {"dental", "bistro", "isp", "shop"}
    cover = Counter((q["business"], q["category"]) for q in raw)
    for business in data["businesses"]:
        for category in CATEGORIES:
            assert cover[(business, category)] >= 3, (business, category)
    for q in raw:
        assert set(q) == {"id", "business", "category", "split", "messages", "must", "must_not"}, q["id"]
        assert q["split"] in ("dev", "holdout"), q["id"]
        assert q["category"] in CATEGORIES and q["business"] in data["businesses"], q["id"]
        assert q["must"] or q["must_not"], q["id"]
        assert all(isinstance(fact, list) and fact for fact in q["must"]), q["id"]
        roles = [m["role"] for m in q["messages"]]
        assert roles[-1] == "user" and roles == ["user", "assistant"] * (len(roles) // 2) + ["user"], q["id"]
        if q["category"] == "followup":
            assert len(roles) in (3, 5), q["id"]  # 2-3 caller turns
        for pattern in q["must_not"] + [a[3:] for fact in q["must"] for a in fact if a.startswith("re:")]:
            re.compile(re.sub(r"\{\{(\w+)\}\}", lambda m: data["macros"][m.group(1)], pattern))


def test_every_business_file_loads_and_every_variant_builds_a_prompt(questions):
    _, data = questions
    for key in data["businesses"]:
        assert business_file(key, data).is_file()
        assert load_business(key, data).name
    from pipeline.config import load_config

    agent = load_config().agent
    for variant in VARIANTS:
        prompts = variant_prompts(variant, agent, data)
        assert set(prompts) == set(data["businesses"]) and all(prompts.values())
    assert variant_prompts("config", agent, data)["dental"] == agent.system_prompt


def test_before_prompts_are_the_old_default_and_the_dialogue_prompts(questions):
    _, data = questions
    before = variant_prompts("before", None, data)
    assert before["dental"].startswith("You are the friendly phone receptionist of Riverside Dental")
    turns = json.loads((QUESTIONS.parent / "dialogues.json").read_text())["turns"]
    for key in ("bistro", "isp", "shop"):
        assert before[key] == next(t["messages"][0]["content"] for t in turns if t["id"].startswith(key + "-"))
    # The new default keeps every figure of the old default prompt.
    from pipeline.config import load_config

    numbers = lambda text: set(re.findall(r"\d+(?:[:.]\d+)?", text))
    assert numbers(before["dental"]) <= numbers(load_config().agent.system_prompt)


def test_scripted_agent_turns_are_themselves_correct(questions):
    """The agent's earlier answers in follow-ups are given to the model as its own: they
    must not carry a false claim of their business."""
    _by_id, data = questions
    for q in data["questions"]:
        for m in q["messages"]:
            if m["role"] == "assistant":
                rules = Rules.build([], data["businesses"][q["business"]]["must_not"], data["macros"])
                assert not check(m["content"], rules).false_claim, (q["id"], m["content"])


# ---------------------------------------------------------------- end to end, tiny model


TINY_BUSINESS = """[business]
name = "Riverside Dental"
role = "receptionist"
greeting = "Hello"
[business.hours]
Saturday = "9 a.m. to 1 p.m."
"""


def tiny_question_set(root):
    """Four short questions (one per category) over one short business: the tiny model's
    context is 1024 byte-level tokens, too short for the real prompts."""
    (root / "b.toml").write_text(TINY_BUSINESS)
    ask = lambda *turns: [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    data = {
        "macros": {"no": r"\bno\b"},
        "businesses": {"tiny": {"config": "b.toml", "before": "Riverside Dental is open Saturday 9 to 1.", "must_not": []}},
        "questions": [
            {"id": "t-single", "business": "tiny", "category": "single", "messages": ask("Open Saturday?"),
             "must": [["9 am"]], "must_not": []},
            {"id": "t-follow", "business": "tiny", "category": "followup",
             "messages": ask("Hi", "Hello!", "Open Saturday?"), "must": [["1 pm"]], "must_not": []},
            {"id": "t-unknown", "business": "tiny", "category": "unknown", "messages": ask("Braces?"),
             "must": [], "must_not": [r"^yes\b"]},
            {"id": "t-premise", "business": "tiny", "category": "false_premise", "messages": ask("Open Sunday, right?"),
             "must": [["re:{{no}}"]], "must_not": []},
        ],
    }
    path = root / "q.json"
    path.write_text(json.dumps(data))
    return path


def test_bench_quality_end_to_end_writes_the_documented_json(tiny_models, tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(f'[llm]\ntarget = "{tiny_models["target"]}"\ndraft = "{tiny_models["target"]}"\n'
                      'device = "cpu"\ndtype = "float32"\ndrafter = "ngram"\nmax_gamma = 4\n')
    out = tmp_path / "quality.json"
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", "quality", "--config", str(config), "--questions", str(tiny_question_set(tmp_path)),
                   "--variants", "before,rules,config,tools", "--max-new-tokens", "6", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["questions"] == 4 and report["max_new_tokens"] == 6
    assert list(report["variants"]) == ["before", "rules", "config", "tools"]
    for entry in report["variants"].values():
        assert {"correct", "false_claim", "by_business", "by_category", "speed", "prefill", "questions"} <= set(entry)
        assert 0.0 <= entry["correct"] <= 1.0 and 0.0 <= entry["false_claim"] <= 1.0
        assert set(entry["by_business"]) == {"tiny"} and set(entry["by_category"]) == set(CATEGORIES)
        assert set(entry["by_split"]) == {"dev"}
        assert {"tokens_per_s", "ttft_s", "first_sentence_s", "tokens_per_pass", "system_prompt_tokens",
                "prefill_s"} <= set(entry["speed"])
        assert entry["prefill"]["tiny"]["tokens"] > 0
        assert [r["id"] for r in entry["questions"]] == ["t-single", "t-follow", "t-unknown", "t-premise"]
        row = entry["questions"][0]
        assert {"id", "business", "category", "question", "answer", "correct", "false_claim", "missing",
                "false_claims", "tokens", "ttft_s", "first_sentence_s", "tokens_per_s"} <= set(row)
        assert 1 <= row["tokens"] <= 6
    # A longer prompt for "rules" than for "before", and "config" reports the config's options.
    v = report["variants"]
    assert v["rules"]["speed"]["system_prompt_tokens"] > v["before"]["speed"]["system_prompt_tokens"]
    assert v["config"]["options"] == {"prompt_layout": "lines", "prompt_rules": True, "prompt_examples": False,
                                      "prompt_persona": "role"}
    assert report["prompts"]["before"]["tiny"] == "Riverside Dental is open Saturday 9 to 1."
    # "tools": the prompt a call with [tools] enabled uses, and each answer notes its tool calls.
    assert "Tools:" in report["prompts"]["tools"]["tiny"] and "Tools:" not in report["prompts"]["config"]["tiny"]
    assert 0.0 <= v["tools"]["tool_call"] <= 1.0 and "tool_call" not in v["config"]
    assert all(isinstance(r["tool_calls"], list) for r in v["tools"]["questions"])


def test_unknown_variant_is_refused(capsys):
    assert main(["bench", "quality", "--variants", "nope"]) == 2
    assert "unknown variant" in capsys.readouterr().err


def test_default_question_file_is_the_repo_one():
    assert QUESTIONS.name == "quality.json" and QUESTIONS.is_file()
