"""Regenerate the launch-options table of docs/training.md from ``virtualflow.LaunchOptions``.

The table sits between two HTML comments in the guide (``BEGIN`` / ``END`` below); everything
between them is replaced by :func:`virtualflow.config.options.markdown_table`. ``--check`` changes
nothing and exits 1 when the guide is out of date (``tests/e2e/test_docs.py`` makes the same check).

    python scripts/gen_options_table.py            # rewrite docs/training.md
    python scripts/gen_options_table.py --check    # exit 1 if it would change
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from virtualflow.config.options import markdown_table

GUIDE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "training.md"
BEGIN = "<!-- BEGIN options table: generated from LaunchOptions by scripts/gen_options_table.py; do not edit -->"
END = "<!-- END options table -->"


def split_guide(text: str) -> tuple[str, str, str]:
    """The guide as (before the table, the table, after it); ValueError without both markers."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{GUIDE.name} has no options table between {BEGIN!r} and {END!r}")
    start += len(BEGIN) + 1  # the table starts on the line after the marker
    return text[:start], text[start:end], text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the table is out of date; write nothing")
    args = parser.parse_args(argv)
    text = GUIDE.read_text()
    before, table, after = split_guide(text)
    new = markdown_table()
    if table == new:
        return 0
    if args.check:
        print(f"{GUIDE} is out of date: run python scripts/gen_options_table.py", file=sys.stderr)
        return 1
    GUIDE.write_text(before + new + after)
    print(f"rewrote the options table of {GUIDE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
