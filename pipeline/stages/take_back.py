"""Taking back a turn that ended too soon: the caller went on speaking before the answer
was heard, so the pause was theirs, not the end of their turn.

    if takes_back(turn, speech_started, window_s):
        take_back(turn, speech_started, turn_taker)

No silence threshold is right for every caller: espeak-ng's "I would like to book a
cleaning for | next Tuesday morning" has a 0.75 s gap that the VAD measured once as
1.004 s, one chunk past the 1.0 s end; "next" had begun 12 ms before the turn ended.
Answered as two turns, the agent says "One moment, please." to "... a cleaning for now."
and then answers half a line. LiveKit Agents resumes the agent's speech after a *false
interruption* (noise the caller did not mean as a turn); this is the same idea turned
round: a *false end* of the caller's turn, caught when they go on.

A turn is taken back when the caller speaks again within `window_s` of its end (a pause
the endpointer measured a little too long; a later start is a new thought, answered as
its own turn, as before), while its answer is not yet heard, or heard for less than
`window_s` before their first syllable (no one reacts to an answer that fast: they were
going on), and while it has not acted (a booking made stays made, so that turn is
answered and the caller's words are a barge-in, as before). Reading the slots, asking for
a name or a refused booking is not acting: nothing changed (`LLMResult.acted_t` is cleared
once an act is known to have written nothing; receptionist.tools.stays_done). On a fast CPU
the plan "book, no name yet" was acted on before the caller went on, and "I would like to
book a cleaning for | next Tuesday morning" was answered as two turns. Taking it back stops the
answer as a barge-in does (the speaker clears the output, the LLM stops between passes),
keeps it out of the history, and gives its audio back to the turn-taker as the first
piece of the turn now being spoken (`TurnTaker.reopen`): the caller's words are answered
once, whole, as if the turn had waited. The call's report lists the turns taken back
apart ("taken_back"), with what was transcribed and begun.
"""

from __future__ import annotations

import time

from pipeline.stages.turn_taking import TurnTaker
from pipeline.turn import Turn
from voice.endpointer import SpeechStarted

__all__ = ["take_back", "takes_back"]


def takes_back(turn: Turn, speech: SpeechStarted, window_s: float, now: float | None = None) -> bool:
    """Whether the caller's speech (`speech`, just declared) takes back `turn`, a voice turn
    still being transcribed or answered. `now`: the monotonic time (the sink stamps the
    answer's first audio on it; `speech` is on the frame clock, which only a real-time
    source shares, so only its own length is used: declared_t - start_t)."""
    if window_s <= 0 or turn.end_of_turn is None or turn.taken_back_t is not None or turn.barge_in.fired:
        return False
    end = turn.end_of_turn
    if end.reason in ("max_length", "flush") or turn.llm.acted_t is not None:
        return False  # not a pause of the caller's; or the turn did something that stays done
    if speech.start_t - end.utterance.declared_t >= window_s:
        return False  # a new start, long after the end (both on the frame clock)
    if turn.speech.audio_s == 0:
        return True  # nothing of the answer has been played
    out = turn.timeline.events.get("first_audio_out")
    if out is None:
        return False  # played, and the sink cannot say when: it may have been heard
    heard_before_speech = ((time.monotonic() if now is None else now) - out) - (speech.declared_t - speech.start_t)
    return heard_before_speech < window_s


def take_back(turn: Turn, speech: SpeechStarted, turns: TurnTaker) -> None:
    """Take `turn` back: its answer stops (as on a barge-in) and its audio begins the turn
    the caller is speaking now. The call keeps it out of the history and the turn list."""
    assert turn.end_of_turn is not None  # takes_back() holds only for a turn a pause ended
    turn.taken_back_t = speech.start_t
    turn.barge_in.fire(speech.declared_t)
    turns.reopen(turn.end_of_turn)
