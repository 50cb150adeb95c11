"""Rewrite the generated tables (between their markers) from bench/results: every table in bench/RESULTS.md, the
latest ones (``bench.report --latest``) in the README."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ((ROOT / "bench" / "RESULTS.md", "results", []), (ROOT / "README.md", "latest", ["--latest"]))

for path, marker, args in TARGETS:
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    tables = subprocess.run([sys.executable, "-m", "bench.report", *args], capture_output=True, text=True,
                            check=True, cwd=ROOT).stdout.strip()
    text = path.read_text()
    assert begin in text and end in text, f"{path.name} lacks its {marker} markers"
    path.write_text(re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda m: f"{begin}\n{tables}\n{end}", text,
                           flags=re.S))
