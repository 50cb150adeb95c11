"""Rewrite the generated blocks of the README and docs/RESULTS.md (between their markers) from bench/results:
``python -m docs.tables``; ``--check`` only says which block is stale (the test suite runs it). Also here:
``python -m docs.tables.frontier`` (the budget sweep's plots and, with ``--missing LENGTH``, its cells still to serve)
and ``python -m docs.tables.targets`` (the issues' target tables)."""

import re
import sys
from pathlib import Path

from docs.tables import frontier, glance, runs, targets

ROOT = Path(__file__).resolve().parents[2]
# (file, marker, what writes its block)
BLOCKS = (("README.md", "glance", glance.table),
          ("README.md", "targets94", lambda: targets.table("targets94")),
          ("docs/RESULTS.md", "sweep", lambda: "\n\n".join(frontier.sweep_table(n) for n in frontier.SWEEP)),
          ("docs/RESULTS.md", "latest", runs.latest_tables),
          ("docs/RESULTS.md", "index", runs.index_table))


def block(marker: str) -> re.Pattern:
    """The generated block between ``<!-- marker:begin -->`` and ``<!-- marker:end -->`` (its tables: group 1)."""
    return re.compile(f"<!-- {marker}:begin -->\n(.*?)\n<!-- {marker}:end -->", flags=re.S)


def stale() -> list[str]:
    """The blocks whose committed text differs from what the results make of them, as ``file: marker``."""
    out = []
    for path, marker, make in BLOCKS:
        found = block(marker).search((ROOT / path).read_text())
        if not found or found.group(1) != make():
            out.append(f"{path}: {marker}")
    return out


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        bad = stale()
        print("\n".join(bad) or "every generated block is up to date")
        return 1 if bad else 0
    for path, marker, make in BLOCKS:
        text = (ROOT / path).read_text()
        assert block(marker).search(text), f"{path} lacks its {marker} markers"
        made = make()
        (ROOT / path).write_text(block(marker).sub(lambda m: f"<!-- {marker}:begin -->\n{made}\n<!-- {marker}:end -->",
                                                   text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
