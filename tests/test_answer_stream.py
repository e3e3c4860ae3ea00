"""The answer's last sentence when the token limit ends it (pipeline/stages/answer.py): an
unfinished sentence after others is not spoken ("They accept Delta Dental and Aet" was,
before) and the call's report keeps it; a finished one, one that is the whole answer, or
any end but the limit, is spoken as before."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from callfakes import FakeModels, ScriptedBackend, ScriptedSTT, ToneTTS
from pipeline.stages.respond import respond
from pipeline.timeline import TurnTimeline
from pipeline.turn import LLMResult, Reply


async def _spoken(groups: list[str], finish: str) -> tuple[list[str], LLMResult]:
    sentences: asyncio.Queue = asyncio.Queue()
    result = LLMResult()
    await respond(ScriptedBackend(groups, finish=finish), [{"role": "user", "content": "Tell me about you."}],
                  Reply(TurnTimeline(), llm=result, sentences=sentences))
    spoken = []
    while (s := sentences.get_nowait()) is not None:
        spoken.append(s)
    return spoken, result


async def test_a_sentence_the_token_limit_cut_is_not_spoken():
    spoken, result = await _spoken(["We are open nine to five. ", "We accept Delta Dental and Aet"], "length")
    assert spoken == ["We are open nine to five."]
    assert result.cut_short == "We accept Delta Dental and Aet"
    assert result.finish_reason == "length" and result.sentences == spoken


async def test_an_answer_that_is_one_unfinished_sentence_is_spoken_rather_than_nothing():
    spoken, result = await _spoken(["We are open nine to five and we accept Delta Dental and Aet"], "length")
    assert spoken == ["We are open nine to five and we accept Delta Dental and Aet"] and result.cut_short == ""


@pytest.mark.parametrize("groups, finish", [
    (["We are open nine to five. ", "We accept Delta Dental and Aetna."], "length"),  # the limit fell after a full stop
    (["We are open nine to five. ", "We accept Delta Dental and Aetna"], "eos"),  # the model ended it: no stop needed
])
async def test_a_finished_sentence_or_the_models_own_end_is_spoken(groups, finish):
    spoken, result = await _spoken(groups, finish)
    assert spoken == ["We are open nine to five.", groups[1].strip()] and result.cut_short == ""


async def test_the_calls_report_keeps_the_sentence_the_limit_cut(tmp_path):
    from pipeline.call import Call
    from pipeline.config import load_config
    from pipeline.io import PacedSink, PushSource

    cfg = load_config("test")
    cfg = cfg.model_copy(update={"report": cfg.report.model_copy(update={"dir": str(tmp_path / "reports")})})
    backend = ScriptedBackend(["Parking is free. ", "It is behind"], finish="length")
    source, sink = PushSource(), PacedSink()
    c = Call.from_models(cfg, FakeModels(stt=ScriptedSTT(lambda audio: "Where do I park?"),
                                         tts=ToneTTS(chunks=1, chunk_s=0.05)), source, sink,
                         backend=backend, mqtt=None)
    run = asyncio.create_task(c.run())
    source.push(0.3 * np.sin(2 * np.pi * 220 * np.arange(6400) / 16000).astype(np.float32))
    source.push(np.zeros(16000 // 2, np.float32))
    await c.wait_turns(1)
    source.close()
    entry = (await run).to_dict()["turns"][0]
    assert entry["agent_text_heard"] == "Parking is free."
    assert entry["cut_short"] == "It is behind" and entry["finish_reason"] == "length"
    assert c.history.exchanges[0][1] == "Parking is free."
