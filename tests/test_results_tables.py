"""The generated tables in the README and bench/RESULTS.md are what bench.report makes of the committed results:
a result committed without `python -m bench.update_readme` (or a table edited by hand) fails here."""

import pytest

from bench.update_readme import ROOT, TARGETS, block, tables


@pytest.mark.parametrize("path,marker,args", TARGETS)
def test_generated_tables_match_the_committed_results(path, marker, args):
    found = block(marker).search((ROOT / path).read_text())
    assert found, f"{path} lacks its {marker} markers"
    assert found.group(1) == tables(args), f"{path}: run `python -m bench.update_readme`"
