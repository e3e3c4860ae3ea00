"""The bookings database: open slots, bookings and messages the agent takes during a call.

One `BookingStore` over SQLite (the default: a file, stdlib `sqlite3`) or PostgreSQL (a
`postgresql://` URL, psycopg 3), through the same SQL. The schema is versioned: the
`schema_version` table records each migration applied, and `open_store` applies the
missing ones in order, so opening an up-to-date database changes nothing.

No double booking is the database's job, not a Python lock's (two processes, or two
machines on PostgreSQL, share the data): a UNIQUE partial index allows one active
booking (`cancelled_at IS NULL`) per slot. Of two callers inserting a booking for the same
slot at the same moment, the database lets exactly one commit; the other gets a unique
violation, which becomes `SlotUnavailable` listing the slots still open. Each booking is
one transaction (SQLite `BEGIN IMMEDIATE` with a busy timeout, so writers queue instead of
failing), so a process killed mid-booking leaves the row whole or absent.

Slots are seeded from the business config (`[business] open_slots`) only while the slots
table is empty, or on an explicit reseed: after that the database is the truth.
"""

from __future__ import annotations

import os
import re
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

from pipeline.receptionist.business import DAYS

__all__ = [
    "DEFAULT_DATABASE", "MIGRATIONS", "Booking", "BookingError", "BookingStore", "DatabaseError", "Message",
    "Migration", "NoSuchBooking", "Slot", "SlotUnavailable", "describe_database", "is_postgres_url",
    "open_store", "resolve_database", "same_name",
]

# `[tools] database = ""`: this file, relative to the working directory (like `[report] dir`).
DEFAULT_DATABASE = "data/bookings.sqlite"
PSYCOPG_HINT = "pip install 'psycopg[binary]'"


class DatabaseError(RuntimeError):
    """The database cannot be opened or used (missing folder, unwritable file, server down)."""


class BookingError(Exception):
    """A request the database refuses for a reason the caller can act on; the message is
    a sentence for the model (it is fed back as the tool's error)."""


class SlotUnavailable(BookingError):
    """The slot does not exist, is closed, or is already booked."""

    def __init__(self, message: str, slot: str, open_slots: list[str]):
        super().__init__(message)
        self.slot = slot
        self.open_slots = open_slots


class NoSuchBooking(BookingError):
    """No active booking matches what the caller gave."""


@dataclass(frozen=True)
class Slot:
    id: int
    label: str  # as configured: "Wednesday 2:15 p.m. with Dr. Moreno"
    day: str  # the weekday the label starts with ("Wednesday"), or "" when it names none
    active: bool  # offered at all (a reseed deactivates slots no longer configured)
    booked: bool  # has an active booking

    @property
    def open(self) -> bool:
        return self.active and not self.booked


@dataclass(frozen=True)
class Booking:
    id: int
    slot: str
    name: str  # exactly as the caller gave it
    phone: str | None
    call_id: str | None
    caller: str | None  # the line's caller ID, when the transport knows it
    created_at: str  # ISO 8601, UTC
    cancelled_at: str | None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Message:
    id: int
    name: str
    text: str
    callback: str | None
    call_id: str | None
    caller: str | None
    created_at: str

    def as_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- schema


@dataclass(frozen=True)
class Migration:
    """One schema step. Statements are shared SQL; `{id}` is the auto-increment key column
    type, which is the one thing the two databases spell differently."""

    version: int
    description: str
    statements: tuple[str, ...]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "slots, bookings (one active booking per slot), messages", (
        """CREATE TABLE slots (
            id {id},
            label TEXT NOT NULL UNIQUE,
            day TEXT NOT NULL,
            active INTEGER NOT NULL DEFAULT 1
        )""",
        """CREATE TABLE bookings (
            id {id},
            slot_id INTEGER NOT NULL REFERENCES slots(id),
            name TEXT NOT NULL,
            phone TEXT,
            call_id TEXT,
            caller TEXT,
            created_at TEXT NOT NULL,
            cancelled_at TEXT
        )""",
        # The no-double-booking guarantee: at most one row per slot that is not cancelled.
        "CREATE UNIQUE INDEX bookings_one_active_per_slot ON bookings(slot_id) WHERE cancelled_at IS NULL",
        """CREATE TABLE messages (
            id {id},
            name TEXT NOT NULL,
            text TEXT NOT NULL,
            callback TEXT,
            call_id TEXT,
            caller TEXT,
            created_at TEXT NOT NULL
        )""",
    )),
)

_ID_COLUMN = {"sqlite": "INTEGER PRIMARY KEY", "postgresql": "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"}
_PG_SCHEMA_LOCK = 0x5EC0B00C  # pg_advisory_xact_lock key: one migrator or seeder at a time


# ---------------------------------------------------------------- where the data lives


def is_postgres_url(database: str | os.PathLike) -> bool:
    return str(database).startswith(("postgresql://", "postgres://"))


def resolve_database(database: str | os.PathLike | None) -> str:
    """The config's `[tools] database` -> a URL or a path: empty means DEFAULT_DATABASE."""
    text = str(database or "").strip()
    return text or DEFAULT_DATABASE


def describe_database(database: str | os.PathLike) -> str:
    """For messages and reports: a path as is, a URL without its password."""
    text = str(database)
    if not is_postgres_url(text):
        return text
    parts = urlsplit(text)
    if parts.password is None:
        return text
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def slot_day(label: str) -> str:
    """The weekday a slot label starts with: "Wednesday 2:15 p.m." -> "Wednesday"."""
    first = label.strip().split(" ", 1)[0].strip(",").lower()
    for day in DAYS:
        if first == day.lower() or (len(first) >= 3 and day.lower().startswith(first)):
            return day
    return ""


def _normal(text: str) -> str:
    """Loose form for matching what the model says against a label: case, dots, commas,
    ":00" and repeated spaces do not matter ("friday 9 am" == "Friday 9:00 a.m.")."""
    text = text.casefold().replace(":00", "")
    text = re.sub(r"[.,;!?]", "", text)
    return " ".join(text.split())


def same_name(a: str, b: str) -> bool:
    """One name, case and spaces aside ("ann  lee" is "Ann Lee"): how a booking is found by its name."""
    return " ".join(a.casefold().split()) == " ".join(b.casefold().split())


# ---------------------------------------------------------------- the two databases


class _SQLite:
    dialect = "sqlite"

    def __init__(self, path: Path):
        self.path = path

    def connect(self):
        # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves. timeout: a
        # writer waits this long for another's transaction instead of failing at once.
        conn = sqlite3.connect(str(self.path), timeout=30.0, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA synchronous = FULL")
        try:
            self._use_wal(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    @staticmethod
    def _use_wal(conn, patience_s: float = 30.0) -> None:
        """WAL: `specvoice bookings` can read while a call writes; commits stay atomic.
        Switching a new file to WAL needs it to itself, and SQLite answers "database is
        locked" at once, without its busy timeout, while another process switches it or
        creates the tables: try again (briefly backing off) until one of them has."""
        deadline, pause = time.monotonic() + patience_s, 0.002
        while True:
            try:
                if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal":
                    return
                conn.execute("PRAGMA journal_mode = WAL").fetchone()
                return  # WAL, or a mode this file system allows (rollback journals are atomic too)
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    @contextmanager
    def transaction(self, conn) -> Iterator[None]:
        # IMMEDIATE takes the write lock up front: two bookings cannot interleave their
        # reads and writes, and a waiting writer honours the busy timeout.
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def sql(self, query: str) -> str:
        return query

    def is_unique_violation(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.IntegrityError) and "UNIQUE" in str(exc)

    def serialize(self, conn) -> None:
        pass  # BEGIN IMMEDIATE already serialises writers

    def table_exists(self, conn, name: str) -> bool:
        return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone() is not None


class _Postgres:
    dialect = "postgresql"

    def __init__(self, url: str):
        self.url = url
        try:
            import psycopg
        except ImportError as exc:
            raise DatabaseError(f"the bookings database {describe_database(url)} is PostgreSQL, which needs psycopg 3: "
                                f"run `{PSYCOPG_HINT}`") from exc
        self.psycopg = psycopg

    def connect(self):
        return self.psycopg.connect(self.url, autocommit=True, connect_timeout=10)

    @contextmanager
    def transaction(self, conn) -> Iterator[None]:
        with conn.transaction():
            yield

    def sql(self, query: str) -> str:
        return query.replace("?", "%s")

    def is_unique_violation(self, exc: BaseException) -> bool:
        return isinstance(exc, self.psycopg.errors.UniqueViolation)

    def serialize(self, conn) -> None:
        # READ COMMITTED lets two first opens both see "no tables" / "no slots" and both
        # create them: one at a time, until the transaction ends.
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_PG_SCHEMA_LOCK,))

    def table_exists(self, conn, name: str) -> bool:
        return conn.execute("SELECT to_regclass(%s)", (name,)).fetchone()[0] is not None


# ---------------------------------------------------------------- the store


class BookingStore:
    """Slots, bookings and messages in one database. Thread-safe: each thread gets its own
    connection (sqlite3 and psycopg connections are not for concurrent use)."""

    def __init__(self, backend, where: str):
        self._backend = backend
        self.where = where  # path or URL without password, for messages
        self.dialect: str = backend.dialect
        self._local = threading.local()
        self._connections: list = []
        self._lock = threading.Lock()  # guards _connections only
        # Test seam: called inside a booking's transaction after its row is written and
        # before the commit (tests kill a process there). None in production.
        self.before_commit: Callable[[], None] | None = None

    # -- connections

    def _conn(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._backend.connect()
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    def _execute(self, query: str, params: tuple = ()):
        return self._conn().execute(self._backend.sql(query), params)

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        with self._backend.transaction(self._conn()):
            yield

    def close(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, []
        for conn in connections:
            try:
                conn.close()
            except Exception:  # closing a connection a dead server dropped: nothing to do
                pass
        self._local = threading.local()

    def __enter__(self) -> BookingStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- schema

    def migrate(self, migrations: tuple[Migration, ...] = MIGRATIONS) -> list[int]:
        """Apply the migrations this database has not had, in version order, each in the
        same transaction as its `schema_version` row. Returns the versions applied."""
        applied = []
        with self._transaction():
            self._backend.serialize(self._conn())
            if not self._backend.table_exists(self._conn(), "schema_version"):
                self._execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, description TEXT NOT NULL, "
                              "applied_at TEXT NOT NULL)")
            done = {row[0] for row in self._execute("SELECT version FROM schema_version").fetchall()}
            for migration in sorted(migrations, key=lambda m: m.version):
                if migration.version in done:
                    continue
                for statement in migration.statements:
                    self._execute(statement.format(id=_ID_COLUMN[self.dialect]))
                self._execute("INSERT INTO schema_version (version, description, applied_at) VALUES (?, ?, ?)",
                              (migration.version, migration.description, _now()))
                applied.append(migration.version)
        return applied

    def schema_versions(self) -> list[int]:
        return [row[0] for row in self._execute("SELECT version FROM schema_version ORDER BY version").fetchall()]

    # -- slots

    def seed_slots(self, labels: list[str] | None, *, reseed: bool = False) -> int:
        """Put the configured slots in the database while it has none (reseed=True: make
        the slots exactly `labels`; slots no longer listed are deactivated, their bookings
        kept). Returns how many slots were added or reactivated."""
        labels = [label for label in (labels or []) if label.strip()]
        changed = 0
        with self._transaction():
            self._backend.serialize(self._conn())
            count = self._execute("SELECT COUNT(*) FROM slots").fetchone()[0]
            if count and not reseed:
                return 0
            if reseed:
                self._execute("UPDATE slots SET active = 0")
            for label in labels:
                row = self._execute("SELECT id, active FROM slots WHERE label = ?", (label,)).fetchone()
                if row is None:
                    self._execute("INSERT INTO slots (label, day, active) VALUES (?, ?, 1)", (label, slot_day(label)))
                    changed += 1
                else:
                    self._execute("UPDATE slots SET active = 1 WHERE id = ?", (row[0],))
                    changed += 1
        return changed

    def slots(self, day: str | None = None, *, only_open: bool = True) -> list[Slot]:
        """Slots in configured order; `day` filters by weekday ("tue", "Tuesday") or, when
        it names no weekday, by words in the label ("Dr. Patel")."""
        rows = self._execute(
            "SELECT s.id, s.label, s.day, s.active, "
            "EXISTS (SELECT 1 FROM bookings b WHERE b.slot_id = s.id AND b.cancelled_at IS NULL) "
            "FROM slots s ORDER BY s.id").fetchall()
        found = [Slot(r[0], r[1], r[2], bool(r[3]), bool(r[4])) for r in rows]
        if only_open:
            found = [s for s in found if s.open]
        if day and day.strip():
            weekday = slot_day(day)
            if weekday:
                found = [s for s in found if s.day == weekday]
            else:
                found = [s for s in found if _normal(day) in _normal(s.label)]
        return found

    def open_slots(self, day: str | None = None) -> list[str]:
        return [s.label for s in self.slots(day)]

    def _unavailable(self, slot: str, why: str) -> SlotUnavailable:
        others = [label for label in self.open_slots() if label != slot]
        offer = "; ".join(others) if others else "none (offer to take a message)"
        return SlotUnavailable(f"slot '{slot}' {why}; open slots: {offer}", slot, others)

    def find_slot(self, text: str) -> Slot:
        """The active slot `text` names: its label (loosely: case, dots, ":00"), or the one
        label that starts with or contains it. Raises SlotUnavailable otherwise."""
        wanted = _normal(text)
        active = [s for s in self.slots(only_open=False) if s.active]
        exact = [s for s in active if _normal(s.label) == wanted]
        if exact:
            return exact[0]
        partial = [s for s in active if wanted and wanted in _normal(s.label)]
        if len(partial) == 1:
            return partial[0]
        if len(partial) > 1:
            raise SlotUnavailable(f"slot '{text}' could be any of: {'; '.join(s.label for s in partial)}; "
                                  "ask which one", text, [s.label for s in partial if s.open])
        raise self._unavailable(text, "does not exist")

    # -- bookings

    def book(self, slot: str, name: str, phone: str | None = None, *, call_id: str | None = None,
             caller: str | None = None) -> Booking:
        """Book `slot` for `name` (stored exactly as given). Exactly one of any number of
        concurrent bookings of one slot succeeds; the others raise SlotUnavailable."""
        found = self.find_slot(slot)
        if not found.open:
            raise self._unavailable(found.label, "is already booked")
        created = _now()
        try:
            with self._transaction():
                active = self._execute("SELECT active FROM slots WHERE id = ?", (found.id,)).fetchone()
                if not active or not active[0]:
                    raise self._unavailable(found.label, "is no longer offered")
                booking_id = self._execute(
                    "INSERT INTO bookings (slot_id, name, phone, call_id, caller, created_at) "
                    "VALUES (?, ?, ?, ?, ?, ?) RETURNING id",
                    (found.id, name, phone, call_id, caller, created)).fetchone()[0]
                if self.before_commit is not None:
                    self.before_commit()
        except Exception as exc:
            if self._backend.is_unique_violation(exc):
                # Another caller's booking of this slot committed first.
                raise self._unavailable(found.label, "was just booked by another caller") from None
            raise
        return Booking(booking_id, found.label, name, phone, call_id, caller, created, None)

    def cancel(self, name: str, *, slot: str | None = None, booking_id: int | None = None) -> Booking:
        """Cancel the active booking under `name` (case and spaces aside) at `slot` or with
        `booking_id`; the slot is open again. Raises NoSuchBooking when none matches."""
        if slot is None and booking_id is None:
            raise NoSuchBooking("say which booking to cancel: give the slot or the booking id")
        with self._transaction():
            query = ("SELECT b.id, s.label, b.name, b.phone, b.call_id, b.caller, b.created_at "
                     "FROM bookings b JOIN slots s ON s.id = b.slot_id WHERE b.cancelled_at IS NULL")
            params: tuple = ()
            if booking_id is not None:
                query += " AND b.id = ?"
                params = (booking_id,)
            rows = self._execute(query, params).fetchall()
            if slot is not None:
                rows = [r for r in rows if _normal(slot) == _normal(r[1]) or (_normal(slot) and _normal(slot) in _normal(r[1]))]
            mine = [r for r in rows if same_name(r[2], name)]
            if len(mine) != 1:
                under_name = [r[1] for r in self._execute(
                    "SELECT b.name, s.label FROM bookings b JOIN slots s ON s.id = b.slot_id "
                    "WHERE b.cancelled_at IS NULL").fetchall() if same_name(r[0], name)]
                what = f"at '{slot}'" if slot is not None else f"with id {booking_id}"
                if len(mine) > 1:
                    raise NoSuchBooking(f"'{name}' has several bookings {what}: {'; '.join(r[1] for r in mine)}; "
                                        "ask which one")
                held = "; ".join(under_name) if under_name else "none"
                raise NoSuchBooking(f"no active booking for '{name}' {what}; bookings under that name: {held}")
            row = mine[0]
            cancelled = _now()
            updated = self._execute("UPDATE bookings SET cancelled_at = ? WHERE id = ? AND cancelled_at IS NULL",
                                    (cancelled, row[0])).rowcount
            if updated != 1:  # PostgreSQL: another call cancelled it since our SELECT
                raise NoSuchBooking(f"the booking for '{name}' at '{row[1]}' was already cancelled")
        return Booking(row[0], row[1], row[2], row[3], row[4], row[5], row[6], cancelled)

    def bookings(self, *, include_cancelled: bool = True) -> list[Booking]:
        query = ("SELECT b.id, s.label, b.name, b.phone, b.call_id, b.caller, b.created_at, b.cancelled_at "
                 "FROM bookings b JOIN slots s ON s.id = b.slot_id")
        if not include_cancelled:
            query += " WHERE b.cancelled_at IS NULL"
        return [Booking(*row) for row in self._execute(query + " ORDER BY b.id").fetchall()]

    # -- messages

    def add_message(self, name: str, text: str, callback: str | None = None, *, call_id: str | None = None,
                    caller: str | None = None) -> Message:
        created = _now()
        with self._transaction():
            message_id = self._execute(
                "INSERT INTO messages (name, text, callback, call_id, caller, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?) RETURNING id",
                (name, text, callback, call_id, caller, created)).fetchone()[0]
        return Message(message_id, name, text, callback, call_id, caller, created)

    def messages(self) -> list[Message]:
        rows = self._execute("SELECT id, name, text, callback, call_id, caller, created_at FROM messages ORDER BY id")
        return [Message(*row) for row in rows.fetchall()]


def _sqlite_path_problem(path: Path) -> str | None:
    """What is wrong with a SQLite path before sqlite3 says something vaguer."""
    if path.is_dir():
        return f"{path} is a folder; give a file path such as {path / 'bookings.sqlite'}"
    parent = path.parent
    if not parent.exists():
        return f"the folder {parent} does not exist; create it (mkdir -p {parent}) or point [tools] database at another file"
    if not parent.is_dir():
        return f"{parent} is not a folder; point [tools] database at a file in a writable folder"
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        return f"{path} is not readable and writable by this user; fix its permissions or use another file"
    if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
        return f"the folder {parent} is not writable by this user; fix its permissions or use another file"
    return None


def open_store(database: str | os.PathLike | None = None, *, open_slots: list[str] | None = None,
               create_folder: bool | None = None) -> BookingStore:
    """Open (creating and migrating as needed) the bookings database: a SQLite file path or
    a `postgresql://` URL; empty/None means DEFAULT_DATABASE. Seeds `open_slots` when the
    database has no slots yet. `create_folder`: make a missing parent folder (default: only
    for DEFAULT_DATABASE; a path the user wrote that does not exist is an error).

    Raises DatabaseError with the path and what to do when it cannot be opened."""
    target = resolve_database(database)
    if is_postgres_url(target):
        backend, where = _Postgres(target), describe_database(target)
        failures: tuple[type[BaseException], ...] = (backend.psycopg.Error,)
    else:
        path = Path(target).expanduser()
        if create_folder is None:
            create_folder = target == DEFAULT_DATABASE
        if create_folder and not path.parent.exists():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise DatabaseError(f"cannot create the folder for the bookings database {path}: {exc}") from exc
        problem = _sqlite_path_problem(path)
        if problem:
            raise DatabaseError(f"cannot open the bookings database {path}: {problem}")
        backend, where = _SQLite(path), str(path)
        failures = (sqlite3.Error,)
    store = BookingStore(backend, where)
    try:
        store.migrate()
        if open_slots:
            store.seed_slots(open_slots)
    except failures as exc:
        store.close()
        connecting = store.dialect == "postgresql" and isinstance(exc, backend.psycopg.OperationalError)
        fix = ("check that the server is running and the URL (user, password, database) is right" if connecting else
               "the database refused the bookings schema; check the user may create tables in it"
               if store.dialect == "postgresql" else
               "check that the file is a SQLite database and its folder is writable, or point [tools] database "
               "(or --database) at another file")
        raise DatabaseError(f"cannot open the bookings database {where}: {exc}; {fix}") from exc
    return store
