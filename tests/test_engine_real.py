"""The embedded default pair (Qwen2.5-Coder 1.5B target, 0.5B draft), int8 on CPU:
speculative greedy output is token-identical to the same engine at gamma = 0.

Needs `specvoice models pull` (the README's test command does it). Without the models
these tests skip, unless SPECVOICE_REQUIRE_MODELS=1 (set by scripts/test.sh), which
turns a missing model into a failure.
"""

import pytest

from conftest import require_model

pytestmark = pytest.mark.models

MESSAGES = [
    [
        {"role": "system", "content": "You are the receptionist of Riverside Dental, 42 Harbor Street. Open Monday to Friday 8 a.m. to 6 p.m. A cleaning costs $89."},
        {"role": "user", "content": "Where are you and when are you open?"},
    ],
    [
        {"role": "system", "content": "You are a support agent of FastLink Internet. Restart the router by unplugging it for 30 seconds."},
        {"role": "user", "content": "My internet is down. What should I do?"},
    ],
    [
        {"role": "system", "content": "You are the host of Luigi's Bistro. Tonight's free tables: 6:30 p.m. for 2, 7:45 p.m. for 4."},
        {"role": "user", "content": "Do you have a table for four tonight?"},
    ],
]


@pytest.fixture(scope="module")
def engine():
    import torch

    from llm.engine import SpeculativeEngine

    target = str(require_model("qwen2.5-coder-1.5b-instruct"))
    draft = str(require_model("qwen2.5-coder-0.5b-instruct"))

    torch.set_num_threads(2)
    return SpeculativeEngine.load(target, draft, drafter="hybrid", gamma="auto", dtype="int8")


def test_default_pair_speculation_is_token_exact(engine):
    from llm.types import SamplingParams

    params = SamplingParams(max_new_tokens=24)
    for messages in MESSAGES:
        prompt = engine.chat_prompt(messages)
        results = {}
        for drafter, gamma in (("none", 0), ("model", 3), ("ngram", "auto"), ("hybrid", "auto")):
            engine.drafter, engine.gamma = drafter, gamma
            ids, groups, stats = engine.generate(prompt, params)
            results[drafter] = ids
            assert [t for g in groups for t in g.token_ids] == ids
            if drafter == "model":
                assert stats.drafted > 0 and stats.tokens_per_pass > 1.0
        assert results["model"] == results["none"]
        assert results["ngram"] == results["none"]
        assert results["hybrid"] == results["none"]
        text = engine.target.tokenizer.decode(results["none"], skip_special_tokens=True)
        assert len(text.split()) >= 3  # a real answer, not noise


def test_default_pair_tokenizers_match(engine):
    from llm.loading import check_tokenizers_match

    check_tokenizers_match(engine.target, engine.draft)
