"""Errors the voice layer raises, each carrying what went wrong and how to fix it.

They subclass the builtin a caller would naturally catch (ValueError for bad audio,
FileNotFoundError for a missing file), so generic handlers still work.
"""

from __future__ import annotations

from pathlib import Path

PULL_HINT = "run `specvoice models pull`"


def _pull_command(name: str) -> str:
    return f"run `specvoice models pull {name}`"


def pull_hint_for(folder: str | Path) -> str:
    """The fix for a missing or broken model file.

    The model store keeps each model in `<home>/models/<catalog name>/`, so the folder
    name is the catalog name in the usual case; voice/ only knows paths, so this is a
    best-effort guess that is still correct advice when the guess is wrong.
    """
    # Takes the model's FOLDER (not a file in it): catalog names contain dots
    # ("whisper-tiny.en"), so a file/folder guess from the suffix would go wrong.
    name = Path(folder).name
    return _pull_command(name) if name else PULL_HINT


class AudioFormatError(ValueError):
    """Audio the voice layer cannot use: unreadable file, wrong rate or shape."""


class ModelLoadError(RuntimeError):
    """A model file that is missing or cannot be loaded; the message names the file and the fix."""

    def __init__(self, message: str, path: str | Path | None = None):
        super().__init__(message)
        self.path = None if path is None else str(path)


class ModelFileMissingError(ModelLoadError, FileNotFoundError):
    """A model file that does not exist."""


class EngineNotInstalledError(ImportError):
    """An optional engine whose Python package is not installed."""


class DeviceUnavailableError(RuntimeError):
    """No sound device (or no PortAudio) to record from or play to."""
