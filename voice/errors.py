"""Errors the voice layer raises, each carrying what went wrong and how to fix it.

They subclass the builtin a caller would naturally catch (ValueError for bad audio,
FileNotFoundError for a missing file), so generic handlers still work.
"""

from __future__ import annotations

from pathlib import Path

PULL_HINT = "run `specvoice models pull`"


def _pull_command(name: str) -> str:
    return f"run `specvoice models pull {name}`"


STORE_MANIFEST = "specvoice-model.json"  # written by the model store (modelstore.py) into each pulled folder


def pull_hint_for(folder: str | Path, expected: str = "a model folder") -> str:
    """A fix that works for a missing or broken model in `folder`.

    A folder the model store pulled carries its manifest, which names the catalog model;
    the store skips a model whose manifest exists, so the fix is to delete the folder and
    pull again. A catalog model that was never pulled is refused before it gets here
    (modelstore.resolve_model names the pull), so any other folder was given by hand
    and no pull can make it: say what is expected instead (`expected`).
    """
    import json

    folder = Path(folder)
    try:
        name = json.loads((folder / STORE_MANIFEST).read_text()).get("name")
    except (OSError, ValueError, AttributeError):
        name = None
    if isinstance(name, str) and name:
        return f"delete {folder} and {_pull_command(name)}"
    return f"give a catalog model name (`specvoice models list` shows them) or {expected}"


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
