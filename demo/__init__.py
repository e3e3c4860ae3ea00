"""The demo: the `specvoice` CLI (demo/commands/), the simulated caller, the report page,
and the four demo businesses (data/businesses/*.toml, whole configs: `--config` one)."""

from pathlib import Path

BUSINESSES = Path(__file__).resolve().parent / "data" / "businesses"
