"""`specvoice bench voice --engines`: its WER normalisation, cost fit and table (pure parts)."""

from __future__ import annotations

from bench.stt_engines import ENGINES, _fit, _wer, engines_table, spoken_words


def test_numbers_count_the_same_written_or_spoken():
    assert spoken_words("Where's my order 48213?") == spoken_words("Where's my order, forty-eight thousand two hundred thirteen.")
    assert spoken_words("Is Dr. Moreno in?") == spoken_words("is doctor moreno in")
    assert _wer(["A table at 7:45 tonight."], ["a table at seven forty-five tonight"])["wer"] == 0.0
    assert _wer(["has never been surpassed"], ["has never been"])["errors"] == 1


def test_cost_is_a_least_squares_line():
    fit = _fit([(1.0, 150.0), (2.0, 200.0), (4.0, 300.0)])
    assert abs(fit["ms_fixed"] - 100.0) < 1e-9 and abs(fit["ms_per_audio_s"] - 50.0) < 1e-9


def test_every_engine_and_window_is_compared():
    names = {e.name for e in ENGINES}
    assert {"whisper-tiny.en / 30 s", "whisper-tiny.en / audio+4 s", "whisper-base / 30 s",
            "whisper-base / audio+4 s", "moonshine-base", "moonshine-base, drafted"} == names
    assert [e.name for e in ENGINES if e.grown] == ["moonshine-base, drafted"]  # heard as a call hears a turn


def test_table_has_a_row_per_engine_and_path():
    per = {s: {"wer": 0.05, "errors": 1, "words": 20} for s in ("lj", "questions", "domain")}
    path = {**per, "noise_with_text": 0, "noise_n": 4, "ms_median": 170.0, "ms_p90": 250.0, "repetition_cuts": 0}
    summary = {"direct": path, "phone": path, "cost": {"ms_fixed": 20.0, "ms_per_audio_s": 50.0}}
    r = {"machine": {"cpus": 2, "cpu": "AMD EPYC"}, "stt_threads": 1,
         "engines": {"moonshine-base": {"summary": summary}, "whisper-base / 30 s": {"summary": summary}}}
    table = engines_table(r)
    assert table.count("| moonshine-base |") == 2 and table.count("| whisper-base / 30 s |") == 2
    assert "20 + 50/s" in table and "5.0% (1/20)" in table
