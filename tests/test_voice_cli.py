"""`specvoice say` and `specvoice transcribe` end to end, and their failure messages."""

from __future__ import annotations


import pytest

from conftest import require_model
from demo.cli import main


def require_models(*names: str) -> None:
    for name in names:
        require_model(name)


def test_help_texts_teach_with_examples(capsys):
    for cmd in ("say", "transcribe"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = capsys.readouterr().out
        assert f"specvoice {cmd} " in out and "--phone" in out


@pytest.mark.models
def test_say_then_transcribe_round_trip(tmp_path, capsys):
    require_models("piper-joe-medium", "whisper-tiny.en")
    wav = tmp_path / "hello.wav"
    assert main(["say", "Good morning, the clinic opens at nine.", "--out", str(wav), "--rate", "16000"]) == 0
    assert wav.stat().st_size > 16000
    capsys.readouterr()
    assert main(["transcribe", str(wav), "--model", "whisper-tiny.en", "--phone"]) == 0
    text = capsys.readouterr().out.lower()
    assert "good morning" in text and "clinic" in text


@pytest.mark.models
def test_transcribe_takes_faster_whisper_names_and_a_vocabulary(tmp_path, capsys):
    """`--model tiny.en` is the catalog's whisper-tiny.en; --vocabulary reaches Whisper."""
    require_models("piper-joe-medium", "whisper-tiny.en")
    wav = tmp_path / "q.wav"
    assert main(["say", "Do you take Delta Dental or only Aetna?", "--out", str(wav), "--rate", "16000"]) == 0
    capsys.readouterr()
    assert main(["transcribe", str(wav), "--model", "tiny.en", "--phone",
                 "--vocabulary", "Riverside Dental, Delta Dental, Aetna, Dr. Patel"]) == 0
    text = capsys.readouterr().out.lower()
    assert "delta dental" in text and "aetna" in text, text


def test_transcribe_refuses_an_unknown_vocabulary_mode(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["transcribe", str(tmp_path / "a.wav"), "--vocabulary", "x", "--vocabulary-mode", "prompt"])
    assert "initial_prompt" in capsys.readouterr().err


def test_transcribe_unreadable_file_names_it(tmp_path, capsys):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"not a wav file at all")
    assert main(["transcribe", str(bad)]) == 1
    assert "bad.wav" in capsys.readouterr().err


def test_missing_model_tells_how_to_pull(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECVOICE_HOME", str(tmp_path / "empty-home"))
    import numpy as np

    from voice.wav import write_wav

    wav = write_wav(tmp_path / "a.wav", np.zeros(1600, np.float32), 16000)
    assert main(["transcribe", str(wav), "--model", "whisper-tiny.en"]) == 1
    assert "specvoice models pull whisper-tiny.en" in capsys.readouterr().err
    assert main(["say", "hello", "--out", str(tmp_path / "o.wav")]) == 1
    assert "specvoice models pull piper-joe-medium" in capsys.readouterr().err


def test_say_coqui_without_package_is_a_clear_error(tmp_path, capsys):
    try:
        import TTS  # noqa: F401
        pytest.skip("coqui-tts is installed here")
    except ImportError:
        pass
    assert main(["say", "hi", "--out", str(tmp_path / "o.wav"), "--engine", "coqui", "--voice", str(tmp_path)]) == 1
    assert "coqui" in capsys.readouterr().err
