"""`specvoice bookings`: what the agent's tools did: bookings, messages, open slots; export."""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

HELP = "list and export the bookings and messages the agent took, and the open slots"
DESCRIPTION = """\
Read the bookings database the agent's tools write to ([tools] database in the config;
default data/bookings.sqlite under the working directory; a postgresql:// URL works too).

  specvoice bookings                          # bookings, newest last (cancelled ones marked)
  specvoice bookings messages                 # messages taken for the staff
  specvoice bookings slots                    # the slots still open
  specvoice bookings slots --reseed           # make the slots exactly [business] open_slots
  specvoice bookings export --format csv --out bookings.csv
  specvoice bookings export --format json --out everything.json
  specvoice bookings --database /srv/specvoice/bookings.sqlite
  specvoice bookings --database postgresql://agent:secret@db.local/specvoice
"""

VIEWS = ("list", "messages", "slots", "export")
TABLES = ("bookings", "messages", "slots")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("view", nargs="?", choices=VIEWS, default="list",
                        help="list (bookings, the default), messages, slots, or export")
    parser.add_argument("--config", metavar="NAME_OR_PATH", help="config file or built-in name (default: default)")
    parser.add_argument("--database", metavar="PATH_OR_URL",
                        help="the database to read, instead of the config's [tools] database")
    parser.add_argument("--active", action="store_true", help="list: leave out cancelled bookings")
    parser.add_argument("--day", help="slots: only this day (e.g. Tuesday)")
    parser.add_argument("--reseed", action="store_true",
                        help="slots: make the database's slots exactly the config's [business] open_slots "
                             "(bookings are kept; slots no longer listed are closed)")
    parser.add_argument("--format", choices=("json", "csv"), default="json", help="export: file format (default json)")
    parser.add_argument("--table", choices=TABLES + ("all",),
                        help="export: which table (default: all for JSON, bookings for CSV)")
    parser.add_argument("--out", metavar="FILE", default="-", help="export: file to write (default: standard output)")


def _fail(message: str) -> int:
    print(f"specvoice bookings: {message}", file=sys.stderr)
    return 1


def _rows(store, table: str) -> list[dict]:
    if table == "bookings":
        return [b.as_dict() for b in store.bookings()]
    if table == "messages":
        return [m.as_dict() for m in store.messages()]
    return [{"id": s.id, "label": s.label, "day": s.day, "active": s.active, "booked": s.booked, "open": s.open}
            for s in store.slots(only_open=False)]


def _columns(rows: list[dict], headers: list[str]) -> str:
    """A plain text table: one line per row, columns padded to their widest cell."""
    def cell(value) -> str:  # one line per row: a message's line breaks shown as \n
        return "" if value is None else str(value).replace("\r", "\\r").replace("\n", "\\n")

    cells = [headers] + [[cell(row.get(h)) for h in headers] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells)


def _export(store, args) -> str:
    table = args.table or ("all" if args.format == "json" else "bookings")
    if args.format == "csv":
        if table == "all":
            raise ValueError("a CSV file holds one table: add --table bookings, --table messages or --table slots")
        rows = _rows(store, table)
        out = io.StringIO()
        fields = list(rows[0]) if rows else _empty_fields(table)
        writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()
    tables = TABLES if table == "all" else (table,)
    data = {"database": store.where, "schema_versions": store.schema_versions()}
    data.update({name: _rows(store, name) for name in tables})
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def _empty_fields(table: str) -> list[str]:
    from pipeline.receptionist.bookings import Booking, Message

    if table == "bookings":
        return list(Booking.__dataclass_fields__)
    if table == "messages":
        return list(Message.__dataclass_fields__)
    return ["id", "label", "day", "active", "booked", "open"]


def run(args: argparse.Namespace) -> int:
    from pipeline.receptionist.bookings import DatabaseError, is_postgres_url, open_store, resolve_database
    from pipeline.config import ConfigError, load_config

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        return _fail(str(exc))
    database = resolve_database(args.database or config.tools.database)
    if not is_postgres_url(database) and not Path(database).expanduser().exists():
        return _fail(f"no bookings database at {database} yet: the agent creates it on the first call with "
                     "[tools] enabled = true; point at another one with --database PATH_OR_URL")
    try:
        store = open_store(database, open_slots=config.business.open_slots, create_folder=False)
    except DatabaseError as exc:
        return _fail(str(exc))
    with store:
        if args.view == "list":
            rows = [b.as_dict() for b in store.bookings(include_cancelled=not args.active)]
            for row in rows:
                row["status"] = f"cancelled {row['cancelled_at']}" if row["cancelled_at"] else "booked"
            print(_columns(rows, ["id", "slot", "name", "phone", "caller", "status", "call_id", "created_at"]))
            print(f"\n{len(rows)} booking(s) in {store.where}")
        elif args.view == "messages":
            rows = [m.as_dict() for m in store.messages()]
            print(_columns(rows, ["id", "name", "text", "callback", "caller", "call_id", "created_at"]))
            print(f"\n{len(rows)} message(s) in {store.where}")
        elif args.view == "slots":
            if args.reseed:
                store.seed_slots(config.business.open_slots, reseed=True)
            labels = store.open_slots(args.day)
            for label in labels:
                print(label)
            where = f" on {args.day}" if args.day else ""
            print(f"\n{len(labels)} open slot(s){where} in {store.where}")
        else:
            try:
                text = _export(store, args)
            except ValueError as exc:
                return _fail(str(exc))
            if args.out == "-":
                sys.stdout.write(text)
            else:
                out = Path(args.out)
                try:
                    out.write_text(text, encoding="utf-8")
                except OSError as exc:
                    return _fail(f"cannot write {out}: {exc}; pick a writable path with --out FILE")
                print(f"wrote {out}")
    return 0
