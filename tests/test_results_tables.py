"""The generated tables in the README and bench/RESULTS.md are what bench.report makes of the committed results:
a result committed without `python -m bench.update_readme` (or a table edited by hand) fails here."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path,marker,args", [("README.md", "latest", ["--latest"]),
                                              ("bench/RESULTS.md", "results", [])])
def test_generated_tables_match_the_committed_results(path, marker, args):
    text = (ROOT / path).read_text()
    block = re.search(f"<!-- {marker}:begin -->\n(.*?)\n<!-- {marker}:end -->", text, flags=re.S)
    assert block, f"{path} lacks its {marker} markers"
    made = subprocess.run([sys.executable, "-m", "bench.report", *args], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout.strip()
    assert block.group(1) == made, f"{path}: run `python -m bench.update_readme`"
