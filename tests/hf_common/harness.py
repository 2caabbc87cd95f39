"""Run ``qwen_suite.py`` (transformers' common model tests, stock and aligned) in subprocesses and compare.

Used by ``tests/test_hf_model_tests.py`` (in ``make test``) and ``tools/bench/hf_model_tests.py`` (writes
``results/bench/hf_model_tests.txt``). One pytest process per architecture, run side by side; each writes a junit
XML whose per-test outcomes are compared class by class against the stock class of the same architecture.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import sdist

HERE = Path(__file__).resolve().parent
SRC = HERE.parent.parent / "src"
SUITE = HERE / "qwen_suite.py"
ARCHS = ("qwen2", "qwen3")
# name -> (variant, engine, kernels) given to apply_alignment by qwen_suite's injection; None = stock
ALIGNMENT_SPECS = {
    "stock": None,
    "full_vllm_compiled": ("full", "vllm-compiled", "eager"),
    "full_vllm_eager": ("full", "vllm-eager", "eager"),
    "full_vllm_compiled_ckernels": ("full", "vllm-compiled", "compiled"),
    "full_vllm_cpu_compiled": ("full", "vllm-cpu-compiled", "eager"),
}
ALIGNMENTS = tuple(ALIGNMENT_SPECS)
# negative controls, not alignments: `full` (vllm-compiled) plus the bug named here, which qwen_suite adds, to see
# whether transformers' tests can tell it from stock
CONTROLS = {
    "control_bf16_in_fp32": "full, then every decoder layer's output rounded to bf16 in fp32 models too (the fp32 "
                            "no-op broken; outputs move ~1e-2)",
    "control_stale_attn_config": "full, then each attention module holds a config copy of its own "
                                 "(set_attn_implementation does not reach attention)",
    "control_rejects_heads": "apply_alignment raising TypeError for the sequence/token-classification and QA heads, "
                             "as if they were unsupported",
}
CONTROL_SPEC = ("full", "vllm-compiled", "eager")
STATUSES = ("passed", "failed", "error", "skipped")


def _env(archs, alignments) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               ROUNDALIGN_HF_ARCHS=",".join(archs), ROUNDALIGN_HF_ALIGNMENTS=",".join(alignments),
               PYTHONPATH=os.pathsep.join([str(SRC), str(HERE), str(sdist.hf_tests_root())]))
    env.pop("RUN_SLOW", None)
    return env


def command(junit: Path, select: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(SUITE), "--rootdir", str(HERE),
           "--confcutdir", str(HERE), "-o", "python_files=qwen_suite.py", "-o", "addopts=", f"--junitxml={junit}"]
    return cmd + (["-k", select] if select else [])


def run(out_dir: Path, archs=ARCHS, alignments=ALIGNMENTS, select: str | None = None, log=print) -> dict:
    """Run the suite, one process per architecture in parallel. Returns ``{"outcomes": {(arch, alignment):
    {test: status}}, "summaries": {arch: pytest's last line}, "seconds": wall time}``."""
    sdist.check_installed_transformers()
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    procs = {}
    for arch in archs:
        log(f"roundalign: transformers' common model tests, {arch} x {', '.join(alignments)}"
            + (f" (-k {select!r})" if select else "") + " ...")
        junit, logf = out_dir / f"{arch}.xml", open(out_dir / f"{arch}.log", "w")
        procs[arch] = (junit, logf, subprocess.Popen(command(junit, select), env=_env([arch], alignments),
                                                     cwd=out_dir, stdout=logf, stderr=subprocess.STDOUT))
    outcomes, summaries = {}, {}
    for arch, (junit, logf, proc) in procs.items():
        rc = proc.wait()
        logf.close()
        lines = (out_dir / f"{arch}.log").read_text().strip().splitlines()
        summaries[arch] = lines[-1] if lines else ""
        if not junit.exists():
            raise RuntimeError(f"{arch}: pytest exited {rc} without a junit report; log:\n" + "\n".join(lines[-40:]))
        outcomes.update(read_junit(junit))
        log(f"  {arch}: {summaries[arch]}")
    return {"outcomes": outcomes, "summaries": summaries, "seconds": time.perf_counter() - t0}


def read_junit(path: Path) -> dict:
    """``{(arch, alignment): {test name: status}}`` from a junit XML of qwen_suite.py."""
    tag_status = {"failure": "failed", "error": "error", "skipped": "skipped"}
    out: dict = {}
    for case in ET.parse(path).iter("testcase"):
        cls = case.get("classname").rsplit(".", 1)[-1]  # "Qwen2_full_vllm_eager"
        arch, alignment = cls.split("_", 1)
        # the last outcome child counts (a case can hold <skipped/> then <failure/>, from its subtests)
        status = ([tag_status[c.tag] for c in case if c.tag in tag_status] or ["passed"])[-1]
        tests = out.setdefault((arch.lower(), alignment), {})
        # a test reported twice (a teardown error after a pass) keeps its worst outcome
        if tests.get(case.get("name")) not in ("failed", "error"):
            tests[case.get("name")] = status
    return out


def counts(tests: dict) -> Counter:
    return Counter(tests.values())


def differences(outcomes: dict) -> dict:
    """``{(arch, alignment): [(test, stock status, aligned status)]}`` for every test whose outcome differs from
    the stock class's (a test missing on one side counts as "absent")."""
    diffs = {}
    for (arch, alignment), tests in sorted(outcomes.items()):
        if alignment == "stock":
            continue
        stock = outcomes[(arch, "stock")]
        diffs[(arch, alignment)] = [(t, stock.get(t, "absent"), tests.get(t, "absent"))
                                    for t in sorted(set(stock) | set(tests)) if stock.get(t) != tests.get(t)]
    return diffs


def counts_table(outcomes: dict) -> str:
    order = list(ALIGNMENTS) + list(CONTROLS)
    rows = [f"{'arch':6} {'alignment':30} " + " ".join(f"{s:>8}" for s in STATUSES)]
    for arch, alignment in sorted(outcomes, key=lambda key: (key[0], order.index(key[1]))):
        c = counts(outcomes[(arch, alignment)])
        rows.append(f"{arch:6} {alignment:30} " + " ".join(f"{c.get(s, 0):8d}" for s in STATUSES))
    return "\n".join(rows)
