"""The aggregate tables (``roundalign aggregate``'s CSVs) the figures read: fixed dtypes, each read once."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

_TABLES = {
    "runs": {"sweep": "str", "model": "str", "variant": "str", "seed": "int64", "step": "int64", "metric": "str",
             "value": "float64", "status": "str"},
    "run_status": {"sweep": "str", "model": "str", "variant": "str", "seed": "int64", "status": "str",
                   "last_step": "float64", "collapse_step": "float64", "collapse_reason": "str",
                   "reward_collapse_step": "float64", "wall_time_s": "float64"},
    "probe": {"sweep": "str", "model": "str", "engine": "str", "variant": "str", "level": "str", "metric": "str",
              "value": "float64"},
    "probe_layers": {"sweep": "str", "model": "str", "engine": "str", "variant": "str", "layer": "int64",
                     "metric": "str", "value": "float64"},
    # only where the sweep attributes its mismatch (attribution: in its config)
    "attribution": {"sweep": "str", "model": "str", "engine": "str", "step": "int64", "source": "str", "mode": "str",
                    "metric": "str", "value": "float64", "ci_low": "float64", "ci_high": "float64"},
}


def table_path(aggregate_dir: str | Path, name: str) -> Path:
    """``<aggregate_dir>/<name>.csv``; FileNotFoundError names what is missing (the directory or the table)."""
    aggregate_dir = Path(aggregate_dir)
    if not aggregate_dir.is_dir():
        raise FileNotFoundError(f"aggregate directory {aggregate_dir} does not exist "
                                f"(run `roundalign aggregate --results R --out {aggregate_dir}` first)")
    path = aggregate_dir / f"{name}.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (written by `roundalign aggregate`)")
    return path


def load_table(aggregate_dir: str | Path, name: str) -> pd.DataFrame:
    """Read ``<aggregate_dir>/<name>.csv`` with fixed dtypes; FileNotFoundError names what is missing."""
    path = table_path(aggregate_dir, name)
    dtypes = _TABLES[name]
    try:
        df = pd.read_csv(path, dtype=dtypes, keep_default_na=False, na_values={c: [""] for c, t in
                                                                            dtypes.items() if t != "str"})
    except (ValueError, pd.errors.ParserError) as exc:
        raise ValueError(f"{path}: not an aggregate table ({exc})") from None
    # Python strings (object dtype), not pandas' default Arrow strings: the figures iterate these columns (sets of
    # models, zips of keys), and iterating an Arrow array element by element was ~3 s of `make figures`.
    return df.astype({c: object for c, t in dtypes.items() if t == "str" and c in df.columns})


class Tables:
    """The aggregate tables of one directory, each read at most once per process: several figures draw from
    runs.csv, the largest table (23 MB for the dose sweep). ``tables[name]`` reads ``<name>.csv`` when first asked
    for (``load_table``'s fixed dtypes for the general tables, pandas' for the stress tables)."""

    def __init__(self, aggregate_dir: str | Path):
        self.dir = Path(aggregate_dir)
        self._cache: dict[str, pd.DataFrame] = {}

    def __getitem__(self, name: str) -> pd.DataFrame:
        if name not in self._cache:
            if name in _TABLES:
                self._cache[name] = load_table(self.dir, name)
            else:
                self._cache[name] = pd.read_csv(table_path(self.dir, name))
        return self._cache[name]

    def has(self, name: str) -> bool:
        return name in self._cache or (self.dir / f"{name}.csv").is_file()


def tables(aggregate: str | Path | Tables) -> Tables:
    """``aggregate`` as a ``Tables`` (a directory path is wrapped; a ``Tables`` is returned as it is)."""
    return aggregate if isinstance(aggregate, Tables) else Tables(aggregate)
