"""Torch's cores belong to the engine thread (llm/threads.py): the thread that loads or
starts an engine runs torch single-threaded afterwards, the engine thread keeps its own
threads, and loading leaves no thread of its own behind."""

import threading

import torch

from llm.scheduler import PassScheduler
from llm.threads import claim, cores, on_own_thread, release


def test_the_engine_thread_keeps_its_threads_when_its_starter_releases():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        sched = PassScheduler(gather_s=0.0)
        assert sched.threads == 2
        assert sched.call(torch.get_num_threads) == 2  # starts the engine thread
        assert torch.get_num_threads() == 1  # the starter was released
        assert cores() == 2  # ...and still knows what it asked for (a second engine)
        torch.ones(1 << 20).sum()  # runs inline here now
        assert sched.call(torch.get_num_threads) == 2
        sched.close()
    finally:
        torch.set_num_threads(before)


def test_threads_started_after_the_engine_run_torch_single_threaded():
    """The sequence of a real engine: loading released the loading thread, then the first
    pass starts the engine thread, whose claim sets the process default to the cores. A
    thread born after that (asyncio's executor, an STT worker) must not get them: its
    first float matmul would make a second OpenMP pool and throttle every pass."""
    before = torch.get_num_threads()
    seen: list[int] = []
    try:
        torch.set_num_threads(2)
        release()  # as SpeculativeEngine.load leaves its caller
        sched = PassScheduler(gather_s=0.0, threads=2)
        assert sched.call(torch.get_num_threads) == 2
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join(10)
        assert seen == [1]
        assert torch.get_num_threads() == 1
        assert sched.call(torch.get_num_threads) == 2
        sched.close()
    finally:
        torch.set_num_threads(before)


def test_claim_survives_a_release_on_another_thread():
    before = torch.get_num_threads()
    seen: list[int] = []
    claimed, released = threading.Event(), threading.Event()

    def engine() -> None:
        claim(2)
        claimed.set()
        released.wait(10)
        torch.ones(1 << 20).sum()  # a parallel op after the process default went to 1
        seen.append(torch.get_num_threads())

    try:
        t = threading.Thread(target=engine)
        t.start()
        assert claimed.wait(10)
        torch.set_num_threads(2)
        release()
        released.set()
        t.join(10)
        assert seen == [2]
    finally:
        torch.set_num_threads(before)


def test_on_own_thread_returns_the_value_and_raises_the_error():
    names: list[str] = []
    assert on_own_thread(lambda: names.append(threading.current_thread().name) or 7) == 7
    assert names and names[0] != threading.current_thread().name

    def fail():
        raise ValueError("no such model")

    try:
        on_own_thread(fail)
    except ValueError as exc:
        assert "no such model" in str(exc)
    else:
        raise AssertionError("the error was not re-raised")
