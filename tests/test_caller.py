"""What the caller tells us about themselves (pipeline/receptionist/caller.py): the name they
gave, a line that only greets, and the reply to it; and the reply as a turn says it (the
respond stage, without the model)."""

from __future__ import annotations

import asyncio

import pytest

from callfakes import ScriptedBackend
from pipeline.receptionist.caller import asks_own_name, caller_name, greeting_reply, greets_only, only_greets, own_reply
from pipeline.stages.respond import respond
from pipeline.timeline import TurnTimeline
from pipeline.turn import LLMResult, Reply


@pytest.mark.parametrize("lines, name", [
    (["Hi, my name is Robert."], "Robert"),
    (["Hello, this is Maria Lopez."], "Maria Lopez"),
    (["Hi, I'm Dana. Do you do teeth whitening?"], "Dana"),
    (["my name is ann lee and I need a cleaning"], "Ann Lee"),  # an STT in lower case
    (["Hey, call me Jo."], "Jo"),
    (["Good morning, my name is Tom Baker. How much is a check-up?"], "Tom Baker"),
    (["Hi, my name is Robert.", "Sorry, my name is Bob."], "Bob"),  # the last one given
    (["Hi, my name is Robert.", "Are you open on Saturday?"], "Robert"),
    (["Hello, I booked a check-up last week under Nora Bell. When is it?"], "Nora Bell"),
    (["It's under Dr. Patel, I think."], None),
    (["Hi, it's Tom."], "Tom"),
    (["It's Aetna."], None),  # "it's X" names the caller only beside a greeting
    (["my name is sam under the booking"], "Sam"),  # a word that ends a name (also the guard's)
    # No name: lower case after "I'm" / "this is", or a word that is no name.
    (["Hi, I'm calling about my bill."], None),
    (["This is about my booking."], None),
    (["I am Looking for a dentist."], None),
    (["This is Tuesday's slot, right?"], None),
    ([], None),
])
def test_caller_name_is_the_name_the_caller_last_gave(lines, name):
    assert caller_name(lines) == name


@pytest.mark.parametrize("text", ["Hi.", "Hi there.", "Hello, this is Maria Lopez.", "Hi, my name is Robert.",
                                  "Oh, hi, this is Priya Shah speaking.", "Good morning!", "Hey, call me Jo.",
                                  "Thanks. My name is Ella, by the way.", "Hi, it's Tom."])
def test_a_greeting_or_an_introduction_alone_only_greets(text):
    assert only_greets(text)


@pytest.mark.parametrize("text", ["", "Yes.", "Okay.", "Thanks.", "Thank you, bye.", "Hi, my name is Robert. Are you open on Saturday?",
                                  "Hi, I'm Dana. Do you do teeth whitening?", "Hello, I'd like to book a cleaning.",
                                  "Hi, I'm calling about my bill.", "my name is ann lee and I need a cleaning"])
def test_a_line_that_asks_or_says_anything_else_does_not(text):
    assert not only_greets(text)


def test_an_introduction_that_answers_the_agents_question_is_no_greeting():
    """ "My name is Leo Hart." to "May I have your name?" completes a booking: it was greeted
    back in the first version (specvoice chat, the bistro)."""
    asked = [{"role": "user", "content": "I'd like a table for two."},
             {"role": "assistant", "content": "I can book tomorrow 9:00 p.m. for you. May I have your name?"},
             {"role": "user", "content": "My name is Leo Hart."}]
    assert not greets_only("My name is Leo Hart.", asked)
    opening = [{"role": "assistant", "content": "Luigi's Bistro, good evening! How can I help?"},
               {"role": "user", "content": "My name is Leo Hart."}]
    assert greets_only("My name is Leo Hart.", opening)
    assert greets_only("Hi.", [{"role": "user", "content": "Hi."}])


def test_the_greeting_back_names_the_caller_when_they_gave_a_name():
    assert greeting_reply("Robert") == "Hi Robert, how can I help you today?"
    assert greeting_reply("Maria Lopez") == "Hi Maria, how can I help you today?"  # the first name
    assert greeting_reply(None) == "Hi, how can I help you today?"


async def _reply_to(text: str, greet_back: bool, backend: ScriptedBackend, before: str = "") -> list[str]:
    sentences: asyncio.Queue = asyncio.Queue()
    earlier = [{"role": "assistant", "content": before}] if before else []
    await respond(backend, [*earlier, {"role": "user", "content": text}],
                  Reply(TurnTimeline(), llm=LLMResult(), sentences=sentences, caller_text=text, greet_back=greet_back))
    spoken = []
    while (s := sentences.get_nowait()) is not None:
        spoken.append(s)
    return spoken


async def test_a_turn_that_only_greets_is_greeted_back_without_the_model():
    backend = ScriptedBackend(["Riverside Dental is at 42 Harbor Street. ", "Our phone number is 555-0142."])
    assert await _reply_to("Hi, my name is Robert.", True, backend) == ["Hi Robert, how can I help you today?"]
    assert backend.opened == 0


async def test_the_model_answers_a_greeting_when_greet_back_is_off_and_any_question_when_on():
    backend = ScriptedBackend(["Hello! ", "How can I help?"])
    assert await _reply_to("Hi, my name is Robert.", False, backend) == ["Hello!", "How can I help?"]
    assert await _reply_to("Hi, my name is Robert. Are you open?", True, backend) == ["Hello!", "How can I help?"]
    assert await _reply_to("My name is Robert.", True, backend, "May I have your name?") == ["Hello!", "How can I help?"]
    assert backend.opened == 3


@pytest.mark.parametrize("text", ["Can you tell me my name, please?", "Do you remember my name?", "What's my name again?",
                                  "what is my name", "Okay, can you tell me what my name is?", "Do you know my name?"])
def test_a_line_that_only_asks_for_the_callers_name(text):
    assert asks_own_name(text)


@pytest.mark.parametrize("text", ["Can you book it under my name?", "Is my name on the booking?", "My name is Robert.",
                                  "What's my name on the order 48213?", "Can you spell my name back to me and book Friday?"])
def test_a_line_that_asks_more_is_not_only_the_name(text):
    assert not asks_own_name(text)


def test_the_callers_name_is_told_in_our_words_only_when_they_gave_it():
    """The 1.5B said "I'm sorry, but I don't have your name." (bench load: every caller asks)
    and "I remember your name." (specvoice chat) to callers who had given it."""
    given = [{"role": "user", "content": "Hi, my name is Robert. Are you open on Saturday?"},
             {"role": "assistant", "content": "Yes, we're open on Saturday from 9 a.m. to 1 p.m."},
             {"role": "user", "content": "Do you remember my name?"}]
    assert own_reply("Do you remember my name?", given) == "Your name is Robert."
    never = [{"role": "user", "content": "Do you remember my name?"}]
    assert own_reply("Do you remember my name?", never) is None  # the model's (and the guard's) to answer
    assert own_reply("Hi, I'm Dana.", [{"role": "user", "content": "Hi, I'm Dana."}]) == "Hi Dana, how can I help you today?"
    assert own_reply("Are you open on Sunday?", given) is None


async def test_the_callers_name_asked_for_is_told_without_the_model():
    backend = ScriptedBackend(["I'm sorry, but I don't have your name."])
    sentences: asyncio.Queue = asyncio.Queue()
    messages = [{"role": "user", "content": "Hi, my name is Robert."}, {"role": "assistant", "content": "Hi Robert!"},
                {"role": "user", "content": "Can you tell me my name, please?"}]
    await respond(backend, messages, Reply(TurnTimeline(), llm=LLMResult(), sentences=sentences,
                                           caller_text=messages[-1]["content"], greet_back=True))
    assert sentences.get_nowait() == "Your name is Robert." and backend.opened == 0
