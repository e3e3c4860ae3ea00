"""The bookings database (pipeline/receptionist/bookings.py) on SQLite and PostgreSQL, and `specvoice bookings`.

Every store test runs on both databases (the `database` fixture); PostgreSQL runs on a
throw-away server (tests/test_bookings_postgres.py) and is skipped, with the reason, only
where psycopg or the server is not installed. Races use barriers and processes killed
at a point they report through a pipe: no sleeps, no timing bounds.
"""

from __future__ import annotations

import csv
import io
import json
import multiprocessing
import os
import signal
import sqlite3
from pathlib import Path

import pytest

from pipeline.receptionist.bookings import (
    DEFAULT_DATABASE, MIGRATIONS, BookingStore, DatabaseError, Migration, NoSuchBooking, Slot, SlotUnavailable,
    open_store, slot_day,
)
from test_bookings_postgres import SLOTS, new_database, pg_server  # noqa: F401 (pg_server: the shared fixture)
from threadrace import race

TUESDAY, WEDNESDAY, FRIDAY = SLOTS
STRANGE_NAME = "  Zoë O'Néill-Ngũgĩ 李 (spelled Z-O-E) "  # stored exactly as given, spaces included
MP = multiprocessing.get_context("spawn")  # a child opens its own connection; nothing inherited


@pytest.fixture(params=["sqlite", "postgres"])
def database(request, tmp_path) -> str:
    """A fresh, empty database: a SQLite file path or a PostgreSQL URL."""
    if request.param == "sqlite":
        return str(tmp_path / "bookings.sqlite")
    return new_database(request.getfixturevalue("pg_server"))


@pytest.fixture
def store(database):
    with open_store(database, open_slots=SLOTS) as opened:
        yield opened


# ---------------------------------------------------------------- schema and seeding


def _tables(store: BookingStore) -> set[str]:
    if store.dialect == "sqlite":
        rows = store._execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    else:
        rows = store._execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'").fetchall()
    return {r[0] for r in rows}


def test_an_empty_database_gets_the_schema_and_a_reopen_changes_nothing(database):
    with open_store(database, open_slots=SLOTS) as store:
        assert store.schema_versions() == [m.version for m in MIGRATIONS] == [1]
        assert {"schema_version", "slots", "bookings", "messages"} <= _tables(store)
        booking = store.book(TUESDAY, "Ann", call_id="c1")
    with open_store(database, open_slots=SLOTS) as store:
        assert store.migrate() == []  # nothing left to apply
        assert store.schema_versions() == [1]
        assert [b.id for b in store.bookings()] == [booking.id]  # data kept across opens


def _open_in_a_process(database: str, barrier, results) -> None:
    barrier.wait(timeout=60)
    try:
        with open_store(database, open_slots=SLOTS) as store:
            results.put(("opened", store.schema_versions(), store.open_slots()))
    except Exception as exc:  # reported to the parent, which asserts on it
        results.put(("failed", repr(exc), None))


def test_processes_opening_a_new_database_at_once_all_succeed(database):
    """Several processes start on a database that does not exist yet: one creates and
    migrates it, the others wait for it (SQLite: WAL switch and BEGIN IMMEDIATE;
    PostgreSQL: an advisory lock); the slots are seeded once."""
    processes = 6
    barrier, results = MP.Barrier(processes), MP.Queue()
    children = [MP.Process(target=_open_in_a_process, args=(database, barrier, results)) for _ in range(processes)]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=120) for _ in children]
    for child in children:
        child.join(timeout=60)
    assert outcomes == [("opened", [1], SLOTS)] * processes


def test_migrations_apply_in_version_order_once(database):
    later = (Migration(3, "notes on messages", ("ALTER TABLE messages ADD COLUMN note TEXT",)),
             Migration(2, "a table for staff", ("CREATE TABLE staff (id {id}, name TEXT NOT NULL)",)))
    with open_store(database, open_slots=SLOTS) as store:
        store.add_message("Ann", "call me", call_id="c1")
        # 3 alters messages, 2 creates staff: given out of order, applied 2 then 3.
        assert store.migrate(MIGRATIONS + later) == [2, 3]
        assert store.migrate(MIGRATIONS + later) == []
        assert store.schema_versions() == [1, 2, 3]
        store._execute("INSERT INTO staff (name) VALUES (?)", ("Dr. Patel",))
        assert [m.text for m in store.messages()] == ["call me"]


def test_a_failing_migration_leaves_the_version_it_was_at(database):
    broken = (Migration(2, "broken", ("CREATE TABLE half (id {id})", "THIS IS NOT SQL")),)
    with open_store(database, open_slots=SLOTS) as store:
        with pytest.raises(Exception):
            store.migrate(MIGRATIONS + broken)
        assert store.schema_versions() == [1]
        assert "half" not in _tables(store)  # the migration's first statement was rolled back too


def test_slots_are_seeded_from_the_config_only_while_there_are_none(database):
    with open_store(database, open_slots=SLOTS) as store:
        assert store.open_slots() == SLOTS
        assert [s.day for s in store.slots()] == ["Tuesday", "Wednesday", "Friday"]
    with open_store(database, open_slots=["Monday 8:00 a.m."]) as store:
        assert store.open_slots() == SLOTS  # the database is the truth once seeded


def test_reseed_makes_the_slots_exactly_the_config_and_keeps_bookings(store):
    store.book(FRIDAY, "Ann", call_id="c1")
    assert store.seed_slots(["Monday 8:00 a.m.", TUESDAY], reseed=True) == 2
    assert store.open_slots() == [TUESDAY, "Monday 8:00 a.m."]
    assert [b.slot for b in store.bookings()] == [FRIDAY]  # a booking outlives its slot's removal
    with pytest.raises(SlotUnavailable) as info:
        store.book(WEDNESDAY, "Bob")  # no longer offered
    assert "does not exist" in str(info.value)
    assert "Monday 8:00 a.m." in str(info.value)


def test_slot_filters_and_loose_names(store):
    assert store.open_slots("tue") == [TUESDAY]
    assert store.open_slots("Friday") == [FRIDAY]
    assert store.open_slots("Dr. Patel") == [TUESDAY, FRIDAY]
    assert store.open_slots("Sunday") == []
    assert store.find_slot("friday 9 am").label == FRIDAY
    assert store.find_slot("Wednesday 2:15 P.M. with Dr. Moreno").label == WEDNESDAY
    with pytest.raises(SlotUnavailable) as info:
        store.find_slot("Dr. Patel")  # two slots: ask which
    assert "could be any of" in str(info.value) and TUESDAY in str(info.value) and FRIDAY in str(info.value)
    assert slot_day("Sat 10 a.m.") == "Saturday" and slot_day("Soon") == ""


# ---------------------------------------------------------------- round trips


def test_book_and_cancel_round_trip_with_a_strange_name(store):
    booking = store.book(WEDNESDAY, STRANGE_NAME, "555-0100", call_id="call-1", caller="+15550100")
    assert (booking.slot, booking.name, booking.phone, booking.call_id, booking.caller) == (
        WEDNESDAY, STRANGE_NAME, "555-0100", "call-1", "+15550100")
    [stored] = store.bookings()
    assert stored == booking and stored.name == STRANGE_NAME  # exactly as given
    assert WEDNESDAY not in store.open_slots()

    with pytest.raises(NoSuchBooking) as info:
        store.cancel("Someone Else", slot=WEDNESDAY)
    assert "no active booking for 'Someone Else'" in str(info.value)
    assert store.bookings()[0].cancelled_at is None

    cancelled = store.cancel(" zoë o'néill-ngũgĩ 李 (spelled z-o-e)", slot="wednesday 2:15 pm")  # case, spaces
    assert cancelled.id == booking.id and cancelled.cancelled_at
    assert store.bookings()[0].cancelled_at == cancelled.cancelled_at
    assert store.bookings(include_cancelled=False) == []
    assert WEDNESDAY in store.open_slots()
    again = store.book(WEDNESDAY, "Bob", call_id="call-2")  # a cancelled booking frees the slot
    assert [b.id for b in store.bookings(include_cancelled=False)] == [again.id]
    with pytest.raises(NoSuchBooking):
        store.cancel(STRANGE_NAME, booking_id=booking.id)  # already cancelled


def test_cancel_by_booking_id_needs_the_name(store):
    booking = store.book(TUESDAY, "Ann Lee")
    with pytest.raises(NoSuchBooking) as info:
        store.cancel("Bob", booking_id=booking.id)
    assert f"with id {booking.id}" in str(info.value)
    assert store.cancel("ann lee", booking_id=booking.id).cancelled_at
    with pytest.raises(NoSuchBooking):
        store.cancel("Ann Lee")  # neither slot nor id


def test_a_booked_slot_is_refused_with_the_other_open_slots(store):
    store.book(TUESDAY, "Ann")
    with pytest.raises(SlotUnavailable) as info:
        store.book(TUESDAY, "Bob")
    assert info.value.open_slots == [WEDNESDAY, FRIDAY]
    assert f"'{TUESDAY}' is already booked" in str(info.value)
    with pytest.raises(SlotUnavailable) as info:
        store.book("Sunday 3 p.m.", "Bob")
    assert "does not exist" in str(info.value) and info.value.open_slots == [WEDNESDAY, FRIDAY]


def test_messages_round_trip(store):
    first = store.add_message(STRANGE_NAME, "Please call about my\ninsurance — Aetna", "555-0199",
                              call_id="call-7", caller="+15550199")
    second = store.add_message("Bob", "running late")
    assert [m.as_dict() for m in store.messages()] == [first.as_dict(), second.as_dict()]
    assert store.messages()[0].name == STRANGE_NAME and store.messages()[0].text.endswith("Aetna")
    assert second.callback is None and second.call_id is None


# ---------------------------------------------------------------- no double booking


def test_the_index_refuses_a_second_active_booking_whatever_the_code_checked(store, monkeypatch):
    """The guarantee is the database's: with the code's own check fooled (both callers read
    the slot as open), the second insert still fails and becomes SlotUnavailable."""
    store.book(FRIDAY, "Ann")
    real = store.find_slot

    def stale(text):
        found = real(text)
        return Slot(found.id, found.label, found.day, True, booked=False)

    monkeypatch.setattr(store, "find_slot", stale)
    with pytest.raises(SlotUnavailable) as info:
        store.book(FRIDAY, "Bob")
    assert "was just booked by another caller" in str(info.value)
    assert info.value.open_slots == [TUESDAY, WEDNESDAY]
    assert [b.name for b in store.bookings()] == ["Ann"]


def test_many_threads_racing_for_one_slot_one_wins(store):
    callers = 12
    results = race(callers, lambda i: store.book(FRIDAY, f"caller {i}", call_id=f"call-{i}"), catch=(SlotUnavailable,))
    assert len(results) == callers
    winners = [r for r in results.values() if not isinstance(r, SlotUnavailable)]
    losers = [r for r in results.values() if isinstance(r, SlotUnavailable)]
    assert len(winners) == 1 and len(losers) == callers - 1
    assert all(exc.open_slots == [TUESDAY, WEDNESDAY] for exc in losers)
    assert [(b.slot, b.name) for b in store.bookings()] == [(FRIDAY, winners[0].name)]


def _book_in_a_process(database: str, index: int, barrier, results) -> None:
    """Child: open its own connection, wait for every other child, book Friday."""
    with open_store(database) as store:
        barrier.wait(timeout=60)
        try:
            booking = store.book(FRIDAY, f"process {index}", call_id=f"call-{index}")
            results.put((index, "booked", booking.id))
        except SlotUnavailable as exc:
            results.put((index, "refused", exc.open_slots))


def test_several_processes_racing_for_one_slot_one_wins(store, database):
    processes = 5
    barrier, results = MP.Barrier(processes), MP.Queue()
    children = [MP.Process(target=_book_in_a_process, args=(database, i, barrier, results)) for i in range(processes)]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=120) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    booked = [o for o in outcomes if o[1] == "booked"]
    refused = [o for o in outcomes if o[1] == "refused"]
    assert len(booked) == 1 and len(refused) == processes - 1
    assert all(o[2] == [TUESDAY, WEDNESDAY] for o in refused)
    [booking] = store.bookings()
    assert booking.id == booked[0][2] and booking.name == f"process {booked[0][0]}"


# ---------------------------------------------------------------- killed mid-booking


def _book_and_hang(database: str, pipe, before_commit: bool) -> None:
    """Child: book Friday, report where it is (inside the transaction, or committed) and
    wait for a message that never comes: the parent kills it with SIGKILL."""
    store = open_store(database)

    def report_and_wait():
        pipe.send("in transaction")
        pipe.recv()

    if before_commit:
        store.before_commit = report_and_wait
    store.book(FRIDAY, "Killed Caller", "555-0000", call_id="killed")
    if not before_commit:
        report_and_wait()


def _kill_at(database: str, before_commit: bool) -> None:
    parent, child_end = MP.Pipe()
    child = MP.Process(target=_book_and_hang, args=(database, child_end, before_commit))
    child.start()
    assert parent.poll(120), "the child never reached the booking"
    assert parent.recv() == "in transaction"
    os.kill(child.pid, signal.SIGKILL)
    child.join(timeout=60)
    assert child.exitcode == -signal.SIGKILL


def test_a_process_killed_before_commit_leaves_no_booking(store, database):
    _kill_at(database, before_commit=True)
    with open_store(database) as after:
        assert after.bookings() == []
        assert after.open_slots() == SLOTS
        assert after.book(FRIDAY, "Next Caller").slot == FRIDAY  # the slot is free, the lock gone
        assert [b.name for b in after.bookings()] == ["Next Caller"]


def test_a_process_killed_after_commit_leaves_the_booking_whole(store, database):
    _kill_at(database, before_commit=False)
    with open_store(database) as after:
        [booking] = after.bookings()
        assert (booking.slot, booking.name, booking.phone, booking.call_id) == (
            FRIDAY, "Killed Caller", "555-0000", "killed")
        assert FRIDAY not in after.open_slots()


# ---------------------------------------------------------------- where the database is (SQLite)


def test_a_missing_folder_is_a_clear_error_naming_the_path(tmp_path):
    path = tmp_path / "no" / "such" / "bookings.sqlite"
    with pytest.raises(DatabaseError) as info:
        open_store(path)
    message = str(info.value)
    assert str(path) in message and f"mkdir -p {path.parent}" in message
    assert not path.parent.exists()  # a path the user wrote is not created behind their back


def test_the_default_database_is_made_under_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open_store("", open_slots=SLOTS) as store:
        assert store.where == DEFAULT_DATABASE
        store.book(TUESDAY, "Ann")
    assert (tmp_path / DEFAULT_DATABASE).is_file()


@pytest.mark.parametrize("case", ["folder", "file as folder", "read-only place", "not a database"])
def test_an_unusable_path_is_a_clear_error_naming_it(case, tmp_path):
    if case == "folder":
        path, expect = tmp_path, "is a folder"
    elif case == "file as folder":
        (tmp_path / "plain").write_text("x")
        path, expect = tmp_path / "plain" / "bookings.sqlite", "is not a folder"
    elif case == "read-only place":
        # /proc refuses new files even to root (these tests may run as root, which
        # file permissions do not stop).
        if not Path("/proc/self").exists():
            pytest.skip("no /proc on this system")
        path, expect = Path("/proc/specvoice-bookings.sqlite"), "writable"
    else:
        path = tmp_path / "bookings.sqlite"
        path.write_bytes(b"this is not a SQLite file, just text that is long enough to have a header" * 20)
        expect = "not a database"
    with pytest.raises(DatabaseError) as info:
        open_store(path)
    assert str(path) in str(info.value) and expect in str(info.value)


def test_two_connections_share_one_sqlite_file(tmp_path):
    """Two stores on one file (two processes' view): a booking made by one is seen and
    refused by the other."""
    path = tmp_path / "shared.sqlite"
    with open_store(path, open_slots=SLOTS) as one, open_store(path, open_slots=SLOTS) as two:
        one.book(TUESDAY, "Ann")
        assert two.open_slots() == [WEDNESDAY, FRIDAY]
        with pytest.raises(SlotUnavailable):
            two.book(TUESDAY, "Bob")
    raw = sqlite3.connect(path)
    assert raw.execute("SELECT COUNT(*) FROM bookings").fetchone()[0] == 1
    raw.close()


# ---------------------------------------------------------------- specvoice bookings


@pytest.fixture
def filled(tmp_path) -> Path:
    path = tmp_path / "bookings.sqlite"
    with open_store(path, open_slots=SLOTS) as store:
        store.book(TUESDAY, STRANGE_NAME, "555-0100", call_id="call-1", caller="+15550177")
        store.book(FRIDAY, "Bob", call_id="call-2")
        store.cancel("bob", slot=FRIDAY)
        store.add_message("Cara", "call me back,\nplease", "555-0102", call_id="call-3")
    return path


def _cli(capsys, *argv) -> tuple[int, str, str]:
    from demo.cli import main

    capsys.readouterr()
    code = main(["bookings", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_lists_bookings_messages_and_slots(filled, capsys):
    code, out, _ = _cli(capsys, "--database", str(filled))
    assert code == 0
    assert STRANGE_NAME.strip() in out and "cancelled" in out and "2 booking(s)" in out
    assert "caller" in out.splitlines()[0] and "+15550177" in out  # who called, as Twilio said
    code, out, _ = _cli(capsys, "list", "--active", "--database", str(filled))
    assert code == 0 and "Bob" not in out and "1 booking(s)" in out
    code, out, _ = _cli(capsys, "messages", "--database", str(filled))
    assert code == 0 and "call me back,\\nplease" in out and "1 message(s)" in out
    code, out, _ = _cli(capsys, "slots", "--database", str(filled))
    assert code == 0 and out.splitlines()[:2] == [WEDNESDAY, FRIDAY]


def test_cli_exports_json_and_csv(filled, tmp_path, capsys):
    out_json = tmp_path / "all.json"
    code, out, _ = _cli(capsys, "export", "--format", "json", "--out", str(out_json), "--database", str(filled))
    assert code == 0 and str(out_json) in out
    data = json.loads(out_json.read_text(encoding="utf-8"))
    assert [b["name"] for b in data["bookings"]] == [STRANGE_NAME, "Bob"]
    assert data["bookings"][1]["cancelled_at"] and data["bookings"][0]["cancelled_at"] is None
    assert data["messages"][0]["text"] == "call me back,\nplease"
    assert [s["label"] for s in data["slots"] if s["open"]] == [WEDNESDAY, FRIDAY]
    assert data["schema_versions"] == [1]

    out_csv = tmp_path / "messages.csv"
    code, _, _ = _cli(capsys, "export", "--format", "csv", "--table", "messages", "--out", str(out_csv),
                      "--database", str(filled))
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out_csv.read_text(encoding="utf-8"))))
    assert [(r["name"], r["text"], r["callback"]) for r in rows] == [("Cara", "call me back,\nplease", "555-0102")]

    code, out, _ = _cli(capsys, "export", "--format", "csv", "--database", str(filled))  # bookings, to stdout
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and [r["name"] for r in rows] == [STRANGE_NAME, "Bob"]


def test_cli_errors_say_what_to_do(filled, tmp_path, capsys):
    missing = tmp_path / "none.sqlite"
    code, _, err = _cli(capsys, "--database", str(missing))
    assert code == 1 and str(missing) in err and "--database" in err
    assert not missing.exists()  # listing does not create a database
    code, _, err = _cli(capsys, "export", "--format", "csv", "--table", "all", "--database", str(filled))
    assert code == 1 and "--table bookings" in err
    code, _, err = _cli(capsys, "export", "--out", str(tmp_path / "no" / "x.json"), "--database", str(filled))
    assert code == 1 and "--out" in err
    code, _, err = _cli(capsys, "--config", str(tmp_path / "nope.toml"))
    assert code == 1 and "config file not found" in err


def test_cli_reads_the_database_from_the_config_and_reseeds(filled, tmp_path, capsys):
    config = tmp_path / "agent.toml"
    config.write_text(f'[tools]\ndatabase = "{filled}"\n\n[business]\nname = "X"\nrole = "receptionist"\n'
                      f'greeting = "Hi"\nopen_slots = ["Monday 8:00 a.m.", "{WEDNESDAY}"]\n')
    code, out, _ = _cli(capsys, "slots", "--config", str(config))
    assert code == 0 and out.splitlines()[:2] == [WEDNESDAY, FRIDAY]  # the database, not the config
    code, out, _ = _cli(capsys, "slots", "--reseed", "--config", str(config))
    assert code == 0 and out.splitlines()[:2] == [WEDNESDAY, "Monday 8:00 a.m."]
