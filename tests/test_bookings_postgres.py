"""PostgreSQL: a throw-away server for the store tests, and what only PostgreSQL has.

`postgres_cluster()` starts Debian's PostgreSQL (initdb + pg_ctl) in a temporary folder,
on 127.0.0.1 and a free port, as the `postgres` user when the tests run as root (the
server refuses root), and stops it and deletes the folder afterwards. tests/test_bookings.py
runs every store test against it as well as against SQLite.

Skipped, with the reason, only when psycopg or the server binaries are not installed;
SPECVOICE_REQUIRE_POSTGRES=1 (set by scripts/test.sh, whose set-up installs both) turns that
skip into a failure.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator

import pytest

from pipeline.receptionist.bookings import DatabaseError, describe_database, open_store
from threadrace import race

def _server_bin() -> Path:
    """Debian's newest installed server (/usr/lib/postgresql/<major>/bin), or where 15 would be."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name)
                   if p.parent.parent.name.isdigit() else 0)
    return found[-1].parent if found else Path("/usr/lib/postgresql/15/bin")


PG_BIN = _server_bin()
SLOTS = ["Tuesday 10:30 a.m. with Dr. Patel", "Wednesday 2:15 p.m. with Dr. Moreno", "Friday 9:00 a.m. with Dr. Patel"]


def unavailable_reason() -> str | None:
    """Why a PostgreSQL server cannot be started here, or None."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg 3 is not installed (pip install 'psycopg[binary]')"
    for tool in ("initdb", "pg_ctl"):
        if not (PG_BIN / tool).is_file():
            return f"PostgreSQL server binaries not found ({PG_BIN / tool}; apt-get install postgresql)"
    return None


def skip_or_fail(reason: str) -> None:
    """Skip without a server, unless SPECVOICE_REQUIRE_POSTGRES=1 says it must be there."""
    if os.environ.get("SPECVOICE_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"{reason} (SPECVOICE_REQUIRE_POSTGRES=1)")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _as_server_user(argv: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: run its tools as `postgres` then."""
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


@contextlib.contextmanager
def postgres_cluster() -> Iterator[str]:
    """A running throw-away server; yields its base URL (postgresql://postgres@127.0.0.1:PORT)."""
    folder = Path(tempfile.mkdtemp(prefix="specvoice-pg-"))
    data, port = folder / "data", _free_port()
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres")
    started = False
    try:
        subprocess.run(_as_server_user([str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
                                        "--no-sync", "-E", "UTF8"]), check=True, capture_output=True, timeout=120)
        # fsync off: a test server; the durability under test is the transaction's, not the disk's.
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {folder} -c fsync=off -c max_connections=60"
        subprocess.run(_as_server_user([str(PG_BIN / "pg_ctl"), "-D", str(data), "-o", options,
                                        "-l", str(folder / "server.log"), "-w", "-t", "60", "start"]),
                       check=True, capture_output=True, timeout=120)
        started = True
        yield f"postgresql://postgres@127.0.0.1:{port}"
    except subprocess.CalledProcessError as exc:
        log = (folder / "server.log").read_text(errors="replace")[-2000:] if (folder / "server.log").exists() else ""
        raise RuntimeError(f"could not start PostgreSQL: {exc.stderr.decode(errors='replace')}\n{log}") from exc
    finally:
        if started:
            subprocess.run(_as_server_user([str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w",
                                            "stop"]), capture_output=True, timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


_names = itertools.count(1)
_names_lock = threading.Lock()


def new_database(server: str) -> str:
    """A fresh, empty database on the server; its URL."""
    import psycopg

    with _names_lock:
        name = f"t{os.getpid()}_{next(_names)}"
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{server}/{name}"


@pytest.fixture(scope="module")
def pg_server():
    reason = unavailable_reason()
    if reason:
        skip_or_fail(reason)
    with postgres_cluster() as url:
        yield url


# ---------------------------------------------------------------- only PostgreSQL


def test_the_server_is_postgres(pg_server):
    import psycopg

    with psycopg.connect(f"{pg_server}/postgres") as conn:
        assert conn.execute("SELECT version()").fetchone()[0].startswith("PostgreSQL")


def test_concurrent_first_opens_migrate_once(pg_server):
    """Several processes' first open of an empty database: the advisory lock lets one
    migrator create the tables; none fails, version 1 is recorded once."""
    url = new_database(pg_server)

    def open_one(i: int) -> None:
        with open_store(url, open_slots=SLOTS):
            pass

    results = race(6, open_one, catch=(BaseException,))  # errors are collected and asserted here
    assert list(results.values()) == [None] * 6
    with open_store(url) as store:
        assert store.schema_versions() == [1]
        assert store.open_slots() == SLOTS  # seeded once, not six times


def test_an_unreachable_server_is_a_clear_error_without_the_password():
    port = _free_port()  # nothing listens there
    url = f"postgresql://agent:s3cret@127.0.0.1:{port}/bookings"
    if unavailable_reason() and "psycopg" in unavailable_reason():
        skip_or_fail(unavailable_reason())
    with pytest.raises(DatabaseError) as info:
        open_store(url)
    message = str(info.value)
    assert "s3cret" not in message
    assert f"postgresql://agent:***@127.0.0.1:{port}/bookings" in message
    assert "server is running" in message


def test_without_psycopg_the_error_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # import psycopg -> ImportError
    with pytest.raises(DatabaseError) as info:
        open_store("postgresql://agent:pw@db.example/bookings")
    assert "pip install 'psycopg[binary]'" in str(info.value)
    assert "pw@" not in str(info.value)


def test_describe_database_hides_only_the_password():
    assert describe_database("postgresql://a:b@h:5/d") == "postgresql://a:***@h:5/d"
    assert describe_database("postgresql://a@h/d") == "postgresql://a@h/d"
    assert describe_database("data/bookings.sqlite") == "data/bookings.sqlite"
