"""Run the dose experiment (configs/dose.yaml) in chunks that fit a working session, and keep what each chunk made.

A chunk is a pair of seeds (chunk k: seeds 2k and 2k + 1) for every dose and variant: 40 runs, about 40 minutes on 2
cores. Its per-run files (results/dose/runs/<model>/<variant>/seed<N>/{run.json,metrics.jsonl}, ~0.8 MB a run) are
packed into results/dose/chunks/seeds-<a>-<b>.tar.xz, which is committed; results/dose/runs/ itself is not (like the
stress sweep's). A later session unpacks every committed chunk (``restore``) before it runs the next one, and the
last step aggregates all of them.

    python -m tools.cluster.dose_chunks targets K   # the Snakemake targets of chunk K (make dose-chunk CHUNK=K runs them)
    python -m tools.cluster.dose_chunks pack K      # pack chunk K's finished runs (refuses an unfinished chunk)
    python -m tools.cluster.dose_chunks restore     # unpack every committed chunk into results/dose/runs/
    python -m tools.cluster.dose_chunks status      # which chunks are committed, which runs exist

Snakemake is run with ``--rerun-triggers code input params software-env`` (no ``mtime``): a fresh clone rebuilds the
warm start (deterministic: every run records the policy's weights fingerprint, and the aggregate step checks they
agree), which is newer than the unpacked runs and would otherwise make Snakemake retrain all of them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "dose.yaml"
RESULTS = Path("results/dose")
CHUNK_SEEDS = 2


def _config() -> dict:
    return yaml.safe_load(CONFIG.read_text())


def chunk_seeds(k: int, cfg: dict | None = None) -> list[int]:
    seeds = sorted((cfg or _config())["seeds"])
    chunks = [seeds[i:i + CHUNK_SEEDS] for i in range(0, len(seeds), CHUNK_SEEDS)]
    if not 0 <= k < len(chunks):
        raise SystemExit(f"chunk {k} does not exist: configs/dose.yaml's seeds {seeds} make chunks 0-{len(chunks) - 1}")
    return chunks[k]


def run_dirs(k: int) -> list[Path]:
    cfg = _config()
    return [RESULTS / "runs" / m / v / f"seed{s}" for m in cfg["models"] for v in cfg["variants"]
            for s in chunk_seeds(k, cfg)]


def archive(k: int) -> Path:
    s = chunk_seeds(k)
    return RESULTS / "chunks" / f"seeds-{s[0]}-{s[-1]}.tar.xz"


def targets(k: int) -> list[str]:
    return [str(d / "run.json") for d in run_dirs(k)]


def pack(k: int) -> Path:
    dirs = run_dirs(k)
    unfinished = [d for d in dirs if not (ROOT / d / "run.json").is_file()
                  or json.loads((ROOT / d / "run.json").read_text()).get("status") not in ("done", "collapsed")]
    if unfinished:
        raise SystemExit(f"chunk {k}: {len(unfinished)} of {len(dirs)} runs are missing or unfinished, e.g. "
                         f"{unfinished[0]}: run `make dose-chunk CHUNK={k}` first")
    out = ROOT / archive(k)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w:xz") as tar:
        for d in dirs:
            for name in ("run.json", "metrics.jsonl"):
                p = ROOT / d / name
                info = tar.gettarinfo(p, arcname=str(d / name))
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""  # reproducible bytes
                with open(p, "rb") as f:
                    tar.addfile(info, f)
    tmp.rename(out)
    return out


def restore() -> list[Path]:
    done = []
    for a in sorted((ROOT / RESULTS / "chunks").glob("seeds-*.tar.xz")):
        with tarfile.open(a) as tar:
            for m in tar.getmembers():
                if not m.isfile() or not m.name.startswith(str(RESULTS / "runs") + "/") or ".." in m.name:
                    raise SystemExit(f"{a}: unexpected member {m.name!r}")
            tar.extractall(ROOT, filter="data")
        done.append(a)
    return done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("targets", "pack", "restore", "status"))
    ap.add_argument("chunk", nargs="?", type=int)
    a = ap.parse_args(argv)
    if a.action in ("targets", "pack") and a.chunk is None:
        ap.error(f"{a.action} needs a chunk number")
    if a.action == "targets":
        print(" ".join(targets(a.chunk)))
    elif a.action == "pack":
        print(f"[dose-chunks] wrote {pack(a.chunk)}")
    elif a.action == "restore":
        for p in restore():
            print(f"[dose-chunks] unpacked {p}")
    else:
        n = len(_config()["seeds"]) // CHUNK_SEEDS + bool(len(_config()["seeds"]) % CHUNK_SEEDS)
        for k in range(n):
            have = sum((ROOT / d / "run.json").is_file() for d in run_dirs(k))
            print(f"chunk {k} (seeds {chunk_seeds(k)}): {'committed' if (ROOT / archive(k)).is_file() else 'not packed'}"
                  f", {have}/{len(run_dirs(k))} runs present")
    return 0


if __name__ == "__main__":
    sys.exit(main())
