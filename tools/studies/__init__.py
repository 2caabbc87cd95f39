"""One-off analyses, each run by hand and writing the record a docs page cites (its docstring names the command and
the record)."""
