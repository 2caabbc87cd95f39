"""Cluster and long-sweep helpers: ``slurm_local.sh`` (``make slurm-up``/``slurm-down``: a one-node SLURM for
tests/test_slurm.py) and ``dose_chunks`` (``make dose-chunk``: the dose sweep in committed chunks)."""
