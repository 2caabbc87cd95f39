"""What crash consistency costs at save time: a checkpoint written with and without the flush.

    python -m tools.bench.checkpoint --out results/bench/checkpoint.txt     # ~1 min on 2 CPU cores

Writes checkpoint-shaped directories like the runner's (bf16 weights as safetensors, fp32 masters and two Adam
moments as one torch.save file, trainer_state.json) for a model of ``--params`` parameters, then completes each
with ``roundalign.training.checkpoints.mark_complete``: with the flush (fsync of every file and directory, then the marker:
the default) and without (``ROUNDALIGN_CKPT_FSYNC=0``: the marker only), alternating, ``--rounds`` each. Reports
the median time to write the files, to complete them, and the ratio of whole saves, all measured in this one run.
The flush's cost is the disk's: it waits until the bytes are on the device instead of in the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from roundalign.training.checkpoints import mark_complete, verify
from roundalign.io import atomic_write_text


def write_files(ckpt: Path, n: int) -> float:
    t0 = time.perf_counter()
    ckpt.mkdir(parents=True)
    save_file({"w": torch.zeros(n, dtype=torch.bfloat16)}, ckpt / "model.safetensors")
    torch.save({"master": torch.zeros(n), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)},
               ckpt / "optimizer.pt")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": int(ckpt.name.split("-")[1])}))
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/bench/checkpoint.txt")
    p.add_argument("--params", type=int, default=20_000_000, help="parameters (default 20M: a 280 MB checkpoint)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir under the run's directory)")
    args = p.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_", dir=Path(args.out).resolve().parent))
    rows = {"fsync": {"write": [], "complete": []}, "no fsync": {"write": [], "complete": []}}
    step = 0
    try:
        for _ in range(args.rounds):
            for mode in ("fsync", "no fsync"):
                step += 1
                ckpt = root / f"checkpoint-{step}"
                rows[mode]["write"].append(write_files(ckpt, args.params))
                os.environ["ROUNDALIGN_CKPT_FSYNC"] = "1" if mode == "fsync" else "0"
                t0 = time.perf_counter()
                mark_complete(ckpt)
                rows[mode]["complete"].append(time.perf_counter() - t0)
                assert verify(ckpt) is None
                shutil.rmtree(ckpt)
    finally:
        os.environ.pop("ROUNDALIGN_CKPT_FSYNC", None)
        shutil.rmtree(root, ignore_errors=True)
    size_mb = args.params * (2 + 3 * 4) / 1e6
    med = {m: {k: statistics.median(v) for k, v in r.items()} for m, r in rows.items()}
    total = {m: med[m]["write"] + med[m]["complete"] for m in med}
    lines = [f"checkpoint save, {args.params / 1e6:.0f}M parameters ({size_mb:.0f} MB: bf16 weights + fp32 masters "
             f"and Adam moments), median of {args.rounds} rounds, alternating",
             "| mode | write files (s) | complete: flush + marker (s) | whole save (s) |", "|---|---:|---:|---:|"]
    for m in med:
        lines.append(f"| {m} | {med[m]['write']:.3f} | {med[m]['complete']:.3f} | {total[m]:.3f} |")
    lines.append(f"whole save with the flush / without: {total['fsync'] / total['no fsync']:.2f}x")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    atomic_write_text(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
