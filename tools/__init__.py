"""The repository's tooling, outside the ``roundalign`` package (not installed with it). Run from the repository root:
``python -m tools.<role>.<name> --help``. One folder per role: ``bench/`` (benchmarks and the docs' bench tables),
``mutation/`` (``make mutation``'s recheck and report), ``docs_gen/`` (generated documentation), ``cluster/`` (the
local SLURM, the dose sweep's chunks), ``studies/`` (one-off analyses); ``gpu_check.py`` is the GPU check."""
