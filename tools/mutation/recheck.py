"""The second tier of ``make mutation``: every mutant that mutmut's fast pass left alive (survived, or reached by no
fast test) runs again, alone, in a fresh pytest process, against the slow tests of its file.

Why a second tier: mutmut runs each mutant inside one long-lived forkserver with a fast test selection
(pyproject.toml [tool.mutmut]). Three kinds of mutant cannot be judged there:
- code that runs at import time (``patch._define_aligned_classes`` builds the aligned classes once, when the
  forkserver imports the package, before any mutant is switched on);
- code reached only under Inductor (the compiled region kernels, ``patch._check_compile_options``), whose tests
  compile for seconds to a minute and are left out of the fast selection;
- code reached only by end-to-end tests (a SIGKILLed ``roundalign train`` subprocess, a saved and reloaded model).
Here each one gets a new interpreter with ``MUTANT_UNDER_TEST`` set before anything is imported, ``PYTHONPATH`` on
mutmut's mutated copy (``mutants/src``; subprocesses the tests start inherit both), and ``pytest -x`` over
the tests its row of ``RECHECK`` names.

Before any mutant, each selection runs once with no mutant active and must pass: a selection that fails on its own
(or breaks under mutmut's trampolines) would make every mutant look killed.

Results go to ``mutants/recheck.json`` (written after each mutant, atomically). A rerun skips each mutant recorded
with the same tests and the same source of its function; ``--retry-survivors`` reruns the recorded survivors too
(after a new test), ``--fresh`` starts over. tools/mutation/report.py counts a mutant recorded as killed as killed.

    python -m tools.mutation.recheck [--jobs 2] [--only PATTERN ...] [--retry-survivors] [--fresh]
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = ROOT / "mutants"
OUT = MUTANTS / "recheck.json"

# mutant-name pattern -> the tests a mutant matching it reruns (the first matching row wins), most telling first:
# pytest -x stops at the first failure, so a killed mutant costs seconds and only a survivor runs the whole list.
# Each row names what the fast pass could not run for those functions.
_P = "roundalign.numerics.patch."
_R = "roundalign.numerics.regions."
# the patch tests (and TrainConfig's kernels default, which calls patch.default_kernels), then the engine-equality
# test: together they kill most patch.py mutants the fast pass missed
_KERNELS_DEFAULT = ("tests/test_settings.py::test_the_train_configs_kernels_default_to_the_engines_mode_and_a_named_"
                    "mode_stays")
_PATCH_ALL = ["tests/test_patch.py", _KERNELS_DEFAULT,
              "tests/test_engine.py::test_full_is_on_policy_with_equal_kernels", "tests/test_engine.py"]
_VJP = "tests/test_regions.py::test_compiled_region_backward_is_inductors_compile_of_the_formulas_vjp"
_COMPILED = [_VJP, "tests/test_regions.py::test_compiled_norm_kernels_of_two_reduction_orders_keep_their_own_order",
             "tests/test_patch.py::test_norm_sum_orders_reach_every_norm_and_are_checked",
             "tests/test_inductor.py", "tests/test_compiled_engine.py"]
_WARNS = "tests/test_torch_compile.py::test_compiling_an_aligned_model_without_emulated_casts_warns_once"
RECHECK: list[tuple[str, list[str]]] = [
    # runs at import: the aligned classes are built once, when the package is imported
    (_P + "x__define_aligned_classes__mutmut_*", ["tests/test_patch.py", "tests/test_engine.py"]),
    # runs only while Dynamo traces an aligned model (comptime)
    (_P + "x__check_compile_options__mutmut_*", [_WARNS]),
    (_P + "x__while_compiling__mutmut_*", [_WARNS]),
    # per-norm reduction orders (vllm-cpu-compiled) and the alignment a saved model carries: compiled/save-load tests
    (_P + "x_norm_modules__mutmut_*", ["tests/test_patch.py", "tests/test_compiled_engine.py"]),
    (_P + "x_region_sites__mutmut_*", ["tests/test_patch.py", "tests/test_compiled_engine.py", "tests/test_dose.py",
                                       "tests/test_moe.py"]),
    (_P + "x__set_sum_orders__mutmut_*", [
        "tests/test_patch.py::test_norm_sum_orders_take_variant_norm_and_a_wrong_count_names_the_norms_the_"
        "model_runs", "tests/test_patch.py", "tests/test_compiled_engine.py"]),
    (_P + "x_recorded_alignment__mutmut_*", [
        "tests/test_patch.py::test_the_recorded_alignment_is_exact_lives_in_the_models_own_config_and_"
        "baseline_removes_it", "tests/test_patch.py", "tests/test_compiled_engine.py"]),
    (_P + "*", _PATCH_ALL + ["tests/test_compiled_engine.py"]),
    # the compiled region kernels and their VJP: Inductor
    (_R + "x__compiled_kernel__mutmut_*", _COMPILED),
    (_R + "x__compiled_vjp__mutmut_*", _COMPILED),
    (_R + "x__by_sum_order__mutmut_*", _COMPILED),
    (_R + "x__with_order__mutmut_*", _COMPILED),
    (_R + "xǁ_RecomputeInBackwardǁbackward__mutmut_*", _COMPILED + ["tests/test_activation_memory.py"]),
    # one autograd node per region: its compiled VJP, and the formula itself inside an outer torch.compile
    (_R + "x__one_node__mutmut_*", [_VJP, "tests/test_torch_compile.py", "tests/test_regions.py",
                                     "tests/test_activation_memory.py", "tests/test_engine.py"]),
    (_R + "*", ["tests/test_regions.py", "tests/test_activation_memory.py", "tests/test_engine.py"]),
    # the engine registry: its records drive the plans, the emulated engine and the guard
    ("roundalign.numerics.engines.*", ["tests/test_engine_registry.py", "tests/test_vllm_guard.py",
                                       "tests/test_regions.py", "tests/test_engine.py"]),
    ("roundalign.numerics.families.*", ["tests/test_families.py", "tests/test_patch.py"]),
    ("roundalign.numerics.compat.*", ["tests/test_library.py"]),
    ("roundalign.numerics.moe.*", ["tests/test_moe.py", "tests/test_families.py"]),
    ("roundalign.numerics.plan.*", ["tests/test_plan.py", "tests/test_regions.py", "tests/test_patch.py",
                                    "tests/test_engine.py"]),
    # the dose (the dose experiment): its rounding, the engine's and the trainer's placement, and training under it
    ("roundalign.numerics.mantissa.*", ["tests/test_dose.py", "tests/test_patch.py", "tests/test_engine.py"]),
    ("roundalign.numerics.dose.*", ["tests/test_dose.py", "tests/test_train.py"]),
    # the engine-scored LM head (`scoring: engine`): its formula against an independent reference, the gradient, and
    # training through it (the real-engine bitwise check lives in tests/vllm_cpu, outside mutmut's copy)
    ("roundalign.numerics.sampler.*", ["tests/test_sampler.py", "tests/test_trl_bridge.py", "tests/test_train.py"]),
    ("roundalign.numerics.x_*", ["tests/test_patch.py", "tests/test_regions.py"]),  # numerics/__init__.py
    # the two end-to-end checkpoint tests SIGKILL a `roundalign train` subprocess (it inherits the mutant)
    ("roundalign.training.checkpoints.*", ["tests/test_checkpoints.py"]),
    ("roundalign.metrics.*", ["tests/test_metrics.py"]),
]


def selection_of(name: str) -> list[str] | None:
    return next((tests for pat, tests in RECHECK if fnmatch.fnmatchcase(name, pat)), None)


# mutmut's exit codes in mutants/**/*.meta: 0 survived, 33 no tests (the ones this tier takes up)
ALIVE = {0: "survived", 33: "no tests"}


def alive_mutants(mutants: Path = MUTANTS) -> dict[str, tuple[str, str]]:
    """Every mutant mutmut's pass left alive: name -> ('survived' | 'no tests', hash of its function's source)."""
    alive = {}
    for meta in sorted((mutants / "src").rglob("*.meta")):
        data = json.loads(meta.read_text())
        for name, code in data["exit_code_by_key"].items():
            if code in ALIVE:
                fn = name.rsplit(".", 1)[1].rsplit("__mutmut_", 1)[0]
                alive[name] = (ALIVE[code], data["hash_by_function_name"].get(fn, ""))
    return alive


def _run(tests: list[str], mutant: str, timeout: float, split: bool = False) -> tuple[int, float, str]:
    """pytest -x over ``tests`` in one process, or with ``split`` one process per test file (in the given order),
    stopping at the first failing file. Split is for a selection that fails in one process with no mutant active:
    under mutmut's trampolines, tests/test_compiled_engine.py's fp32 check failed after tests/test_patch.py had run in
    the same process (it passes alone, and after it without the trampolines)."""
    env = dict(os.environ, MUTANT_UNDER_TEST=mutant, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(MUTANTS / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    groups: dict[str, list[str]] = {}
    for t in tests:
        groups.setdefault(t.split("::")[0] if split else "", []).append(str(ROOT / t))
    t0, rc, tail = time.monotonic(), 0, ""
    for ids in groups.values():
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", "-rfE", *ids]
        left = timeout - (time.monotonic() - t0)
        try:
            p = subprocess.run(cmd, cwd=MUTANTS, env=env, capture_output=True, text=True, timeout=max(left, 1))
            rc, tail = p.returncode, (p.stdout + p.stderr)[-1500:]
        except subprocess.TimeoutExpired:
            rc, tail = -1, f"timeout after {timeout:.0f} s"
        if rc != 0:
            break
    return rc, time.monotonic() - t0, tail


def _first_failure(tail: str) -> str:
    for line in tail.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ")[0]
    return tail.strip().splitlines()[-1] if tail.strip() else ""


def _save(results: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=MUTANTS, prefix=".recheck-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    os.replace(tmp, OUT)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    ap.add_argument("--only", action="append", help="fnmatch pattern on mutant names, repeatable (default: all alive)")
    ap.add_argument("--fresh", action="store_true", help="forget mutants/recheck.json and recheck everything")
    ap.add_argument("--retry-survivors", action="store_true",
                    help="rerun the mutants recorded as survivors too (after adding tests that should kill them)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mutant before it counts as a timeout")
    args = ap.parse_args(argv)
    if not (MUTANTS / "src").is_dir():
        sys.exit("mutation_recheck: no mutants/src: run `make mutation` (mutmut's pass) first")

    alive = {n: s for n, s in alive_mutants().items() if any(fnmatch.fnmatchcase(n, p) for p in args.only or ["*"])}
    unknown = sorted(n for n in alive if selection_of(n) is None)
    if unknown:
        sys.exit(f"mutation_recheck: no RECHECK row matches {unknown[0]} (and {len(unknown) - 1} more); "
                 f"add one to RECHECK in tools/mutation/{Path(__file__).name}")
    results = {} if args.fresh or not OUT.exists() else json.loads(OUT.read_text())
    # a result is reused only for the same selection and the same function source (mutmut renumbers the mutants of
    # a function whose source changed)
    todo = [n for n in sorted(alive)
            if (results.get(n, {}).get("tests"), results.get(n, {}).get("hash")) != (selection_of(n), alive[n][1])
            or (args.retry_survivors and results[n]["verdict"] != "killed")]
    selections = sorted({tuple(selection_of(n)) for n in todo})
    print(f"mutation_recheck: {len(alive)} alive after mutmut's pass, {len(todo)} to run "
          f"({len(alive) - len(todo)} already rechecked), {args.jobs} at once", flush=True)
    if not todo:
        return 0

    baselines = results.setdefault("__baselines__", {})

    def baseline(tests: tuple[str, ...]) -> tuple[str, dict, str]:
        key = " ".join(tests)
        if isinstance(baselines.get(key), dict) and baselines[key]["rc"] == 0:
            return key, baselines[key], ""
        for split in (False, True):
            rc, secs, tail = _run(list(tests), "", args.timeout, split)
            print(f"  baseline ({secs:.0f} s, rc {rc}{', one process per file' if split else ''}): {key}", flush=True)
            if rc == 0:
                break
        return key, {"rc": rc, "split": split}, tail

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each selection must pass with no mutant active
        for key, base, tail in pool.map(baseline, selections):
            baselines[key] = base
            if base["rc"] != 0:
                print(tail)
                _save(results)
                sys.exit(f"mutation_recheck: the selection `{key}` fails with no mutant active; fix it first")
    _save(results)

    done = 0

    def one(name: str) -> None:
        nonlocal done
        tests = selection_of(name)
        rc, secs, tail = _run(tests, name, args.timeout, baselines[" ".join(tests)]["split"])
        verdict = "survived" if rc == 0 else "timeout" if rc == -1 else "error" if rc in (4, 5) else "killed"
        results[name] = {"tests": tests, "rc": rc, "verdict": verdict, "seconds": round(secs, 1),
                         "was": alive[name][0], "hash": alive[name][1], "by": _first_failure(tail) if verdict != "survived" else ""}
        _save(results)
        done += 1
        print(f"  [{done}/{len(todo)}] {verdict:8s} {secs:6.1f} s  {name}  {results[name]['by']}", flush=True)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, todo))
    verdicts = [results[n]["verdict"] for n in alive if n in results]
    print(f"mutation_recheck: of {len(alive)} alive, killed {verdicts.count('killed')}, "
          f"survived {verdicts.count('survived')}, other {len(verdicts) - verdicts.count('killed') - verdicts.count('survived')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
