"""The stages of a call, one job each, in the order a caller's words flow through them:

    listen   source frames -> endpointer -> SpeechStarted / SpeechEnded
    respond  messages -> LLM token groups -> complete sentences (the first one at once)
    speak    sentences -> TTS -> paced output, a mark after each sentence -> what was heard

The call's turn runner (pipeline/call.py) connects them with queues and owns each turn.
"""
