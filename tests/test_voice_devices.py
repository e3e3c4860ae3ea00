"""Sound devices: a missing PortAudio or device is a clear error pointing at `specvoice call`."""

from __future__ import annotations

import sys
import types

import pytest

from voice import devices
from voice.errors import DeviceUnavailableError


def _portaudio_present() -> bool:
    try:
        import sounddevice  # noqa: F401
    except OSError:
        return False
    return True


@pytest.mark.skipif(_portaudio_present(), reason="PortAudio is installed on this machine")
def test_missing_portaudio_says_what_is_missing_and_what_to_run():
    with pytest.raises(DeviceUnavailableError) as info:
        devices.check_device("input")
    msg = str(info.value)
    assert "PortAudio" in msg and "specvoice call" in msg


def _fake_sounddevice(query):
    fake = types.ModuleType("sounddevice")
    fake.query_devices = query
    return fake


def test_no_default_device_says_so(monkeypatch):
    def query(device=None, kind=None):
        # What sounddevice does when the default device index is -1.
        raise ValueError(f"No {kind} device matching -1")

    monkeypatch.setitem(sys.modules, "sounddevice", _fake_sounddevice(query))
    with pytest.raises(DeviceUnavailableError, match=r"no microphone \(input\) sound device.*specvoice call"):
        devices.check_device("input")
    with pytest.raises(DeviceUnavailableError, match=r"no speaker \(output\) sound device"):
        devices.Speaker(16000)


def test_device_without_channels_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "sounddevice", _fake_sounddevice(
        lambda device=None, kind=None: {"name": "HDMI", "max_input_channels": 0, "max_output_channels": 2}))
    with pytest.raises(DeviceUnavailableError, match="HDMI.*no input channels"):
        devices.check_device("input")
    assert devices.check_device("output")["name"] == "HDMI"


async def test_microphone_fails_before_yielding(monkeypatch):
    def query(device=None, kind=None):
        raise ValueError("No input device matching -1")

    monkeypatch.setitem(sys.modules, "sounddevice", _fake_sounddevice(query))
    with pytest.raises(DeviceUnavailableError):
        async for _ in devices.microphone():
            pass


def test_bad_kind_is_refused():
    with pytest.raises(ValueError):
        devices.check_device("both")
