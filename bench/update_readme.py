"""Rewrite the generated tables (between their markers) from bench/results: in docs/RESULTS.md every table, the
latest ones (``bench.report --latest``), the issues' targets (``bench.targets``) and the budget sweep
(``bench.frontier --tables``); in the README the at-a-glance table (``bench.glance``) and issue #94's targets."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (file, marker, the command printing its tables)
TARGETS = (("docs/RESULTS.md", "results", ["bench.report"]), ("docs/RESULTS.md", "latest", ["bench.report", "--latest"]),
           ("README.md", "glance", ["bench.glance"]),
           ("docs/RESULTS.md", "targets10", ["bench.targets", "targets10"]),
           ("docs/RESULTS.md", "targets11", ["bench.targets", "targets11"]),
           ("README.md", "targets94", ["bench.targets", "targets94"]),
           ("docs/RESULTS.md", "sweep", ["bench.frontier", "--tables"]))


def block(marker: str) -> re.Pattern:
    """The generated block between ``<!-- marker:begin -->`` and ``<!-- marker:end -->`` (its tables: group 1)."""
    return re.compile(f"<!-- {marker}:begin -->\n(.*?)\n<!-- {marker}:end -->", flags=re.S)


def tables(args: list[str]) -> str:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout.strip()


def main():
    for path, marker, args in TARGETS:
        text = (ROOT / path).read_text()
        assert block(marker).search(text), f"{path} lacks its {marker} markers"
        made = tables(args)
        (ROOT / path).write_text(block(marker).sub(
            lambda m: f"<!-- {marker}:begin -->\n{made}\n<!-- {marker}:end -->", text))


if __name__ == "__main__":
    main()
