"""``make bench``: each module measures one thing and writes its record under results/bench/; ``tables`` writes the
docs' tables from those records (``python -m tools.bench.tables --check``: tests/test_docs.py)."""
