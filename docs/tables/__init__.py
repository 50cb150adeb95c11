"""The generator of the README's and docs/RESULTS.md's tables from bench/results (``python -m docs.tables``)."""
