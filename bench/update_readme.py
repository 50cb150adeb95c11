"""Rewrite the README's generated tables (between the two markers) from bench/results."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

tables = subprocess.run([sys.executable, "-m", "bench.report"], capture_output=True, text=True, check=True,
                        cwd=README.parent).stdout.strip()
text = README.read_text()
text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda m: f"{BEGIN}\n{tables}\n{END}", text, flags=re.S)
README.write_text(text)
