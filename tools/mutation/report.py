"""results/bench/mutation.txt from a finished ``mutmut run`` (``make mutation``): counts, score, and one line per
surviving (or untested) mutant with why it is allowed to live.

Reads mutmut's own records (``mutants/**/*.meta``: exit code per mutant; ``mutants/mutmut-stats.json``: which tests
reach which function), the second tier's (``mutants/recheck.json``, tools/mutation/recheck.py: each mutant mutmut
left alive, rerun alone in a fresh process against the slow tests of its file) and the run's configuration
(``[tool.mutmut]`` in pyproject.toml). A mutant the second tier killed counts as killed; one it did not recheck (or
rechecked at another version of its function) keeps mutmut's verdict. Exits 1 when a survivor has no entry in
``EXPLAINED`` (after writing the file): a new survivor needs a test that kills it, or an explanation here.

Score = killed / total. "killed" counts a mutant whose tests failed or whose test process died (mutmut's "segfault":
the fault-injection mutants of checkpoints.fault_point SIGKILL the test process itself).
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import platform
import subprocess
import sys
import tomllib
from collections import Counter
from importlib.metadata import version
from pathlib import Path

from tools.mutation.recheck import alive_mutants

ROOT = Path(__file__).resolve().parents[2]

# Survivors allowed to live, with the reason. Keys: a mutant name, or a pattern (fnmatch) for a group that shares one
# reason (each group names the lines it covers). Keep this list short and honest: a mutant that changes behaviour
# a user can see gets a test instead.
EXPLAINED: dict[str, str] = {
    # -- equivalent: no input can tell them apart -----------------------------------------------------------------
    "roundalign.training.checkpoints.x_mark_complete__mutmut_5":
        'equivalent: os.environ.get(..., None) for the default "1": any default outside ("", "0") means flush',
    "roundalign.training.checkpoints.x_mark_complete__mutmut_7":
        "equivalent: os.environ.get(name) (default None) for the default \"1\": None is not in ('', '0') either",
    "roundalign.training.checkpoints.x_mark_complete__mutmut_10":
        'equivalent: default "XX1XX" for "1": any default outside ("", "0") means flush',
    "roundalign.training.checkpoints.x_rotate__mutmut_9":
        "equivalent: `keep >= 0` for `keep > 0` after `keep and`: keep == 0 is already falsy",
    # the spec is padded as (spec.split("@") + ["", "", "", ""])[:4]; split yields >= 1 field, so the 4th pad never
    # reaches the four, and the 3rd only for a spec with no "@" at all, where it is `match`
    "roundalign.training.checkpoints.x_fault_point__mutmut_13":
        'equivalent: the 3rd pad ("XXXX" for "") is read only for a spec without "@" (then `match`), whose step "" '
        "fails int() (ValueError) at its point and returns elsewhere before `match` is read, either way",
    "roundalign.training.checkpoints.x_fault_point__mutmut_14":
        'equivalent: the 4th pad ("XXXX" for "") is never within [:4]: split("@") yields at least one field',
    "roundalign.metrics.x__check_inputs__mutmut_8":
        "equivalent for valid inputs: `break` for `continue` when a tensor argument is None; only entropy (the last "
        "of the three) may be None, so nothing is left unchecked (a None train_logp fails later either way)",
}

# Tier 2 rechecks the compiled region kernels against Inductor (RECHECK's _COMPILED row); these survive it.
_DYNAMIC = ("equivalent on the CPU: dynamic=False/None for dynamic=True only decides whether Inductor specializes the "
            "graph to each shape; its CPU kernels round every region alike either way "
            "(tests/test_inductor.py::test_region_kernels_compile_to_the_same_bits_with_dynamic_or_static_shapes)")
EXPLAINED.update({
    **{f"roundalign.numerics.regions.x__compiled_kernel__mutmut_{i}": _DYNAMIC for i in (2, 4, 9, 18, 20, 21)},
    **{f"roundalign.numerics.regions.x__compiled_vjp__mutmut_{i}": _DYNAMIC for i in (18, 20, 21)},
    "roundalign.numerics.regions.x__compiled_kernel__mutmut_11":
        "equivalent: building every region through _by_sum_order: a region without an order is then built for "
        "order None, and _with_order(fn, None) is fn, so the kernel is torch.compile(fn, dynamic=True) as before",
    **{f"roundalign.numerics.regions.x__compiled_vjp__mutmut_{i}":
       "equivalent: when sum_order is not popped from the keywords, the order reaches the formula through them "
       "instead of being bound by _with_order; sum_sq_in_order's int() makes Dynamo specialize on it either way, so "
       "one graph per order and the same bits (the compiled-VJP test passes a non-default order)"
       for i in (29, 33, 34, 37, 38)},
})

_CPU_DEVICE = ("equivalent on the CPU: device=None (or no device) allocates on the CPU, where the inputs are; on an "
               "accelerator it would fail loudly (tools/gpu_check.py runs these nodes on the GPU)")
_AUTOGRAD_CAST = ("equivalent: the gradient is computed in fp32 and rounded to the input's dtype once either way, by "
                  "this cast/copy or, when it is dropped, by autograd, which casts a returned gradient to its input's "
                  "dtype (validate_outputs); bits are equal")
EXPLAINED.update({
    "roundalign.numerics.regions.x_sum_sq_in_order__mutmut_58":
        "equivalent: v has 2*half lanes at that point, so v[..., half:3*half] is v[..., half:2*half]",
    **{f"roundalign.numerics.regions.xǁ_RecomputeInBackwardǁbackward__mutmut_{i}":
       "equivalent: a gradient returned for an input that needs none is dropped by autograd" for i in (18, 32, 35)},
    "roundalign.numerics.regions.xǁ_RecomputeInBackwardǁbackward__mutmut_56":
        "equivalent: materialize_grads is on, so autograd never passes None for an output's gradient, and every region "
        "output depends on its inputs (requires_grad whenever a gradient arrives)",
    **{f"roundalign.numerics.regions.xǁ_RecomputeInBackwardǁbackward__mutmut_{i}":
       "equivalent: allow_unused matters only for an input that does not reach the outputs; every input of every "
       "region formula does" for i in (69, 74, 75)},
    **{f"roundalign.numerics.regions.x__swiglu_fused_chunked__mutmut_{i}": _CPU_DEVICE for i in (4, 7)},
    **{f"roundalign.numerics.regions.x__swiglu_fused_backward__mutmut_{i}": _CPU_DEVICE for i in (4, 7, 11, 14)},
    **{f"roundalign.numerics.regions.x__swiglu_fused_backward__mutmut_{i}": _AUTOGRAD_CAST for i in (3, 6, 10, 13, 30,
                                                                                                    35)},
    "roundalign.numerics.regions.x__rope_fused_backward__mutmut_10": _AUTOGRAD_CAST,
    "roundalign.numerics.regions.xǁ_RopeFusedǁbackward__mutmut_5": _AUTOGRAD_CAST,
})

EXPLAINED.update({
    **{f"roundalign.numerics.regions.x__one_node__mutmut_{i}":
       "equivalent for every caller: out_dtype None (or left out) in the RoPE node's outer-compile branch; its one "
       "caller, the aligned attention (patch._qk_norm_rope), passes no out_dtype, so it is None, the default"
       for i in (8, 12)},
    **{f"roundalign.numerics.regions.x__one_node__mutmut_{i}":
       "equivalent in values: RoPE then runs through the recomputing node, which saves x too: memory, not bits, and "
       "within the 110% of baseline activation bytes that tests/test_activation_memory.py asserts (tier 2 ran it)"
       for i in (3, 4)},
    "roundalign.numerics.regions.x__one_node__mutmut_59":
        "equivalent in values: eager kernels then run SwiGLU unchunked through the recomputing node (as 57/58), and "
        "compiled ones the eager chunked formula and its eager backward, which round as Inductor's SwiGLU does "
        "(forward: tests/test_inductor.py::test_silu_and_mul_compiled_equals_fused; backward: the compiled-VJP "
        "test's swiglu case passed with this mutant in tier 2): speed, not bits",
    "roundalign.numerics.regions.xǁ_RopeFusedǁforward__mutmut_5": _AUTOGRAD_CAST + " (x_dtype None: .to(None) "
        "keeps the fp32 gradient, which autograd then casts to x's dtype)",
    **{f"roundalign.numerics.regions.x__one_node__mutmut_{i}":
       "equivalent in values: SwiGLU then runs unchunked (the chunks exist for memory; _swiglu_fused_chunked is "
       "bitwise swiglu_fused, test_row_chunks_cover_every_row_once_in_chunks_of_the_element_budget); the chunks bound "
       "the forward's transient fp32 temporaries, not the bytes saved for backward that "
       "tests/test_activation_memory.py counts" for i in (57, 58)},
})

EXPLAINED.update({
    **{f"roundalign.numerics.patch.x__define_aligned_classes__mutmut_{i}":
       "equivalent: type() sets __module__ from the calling module's __name__ (roundalign.numerics.patch) and "
       "__qualname__ to the class name when the namespace lacks them, so dropping either key changes nothing "
       "(tests/test_patch.py::test_alignment_of_a_never_aligned_model_and_the_aligned_classes_names pins both)"
       for i in (33, 34, 35, 36)},
    **{f"roundalign.numerics.patch.x__check_compile_options__mutmut_{i}":
       "equivalent with torch 2.13.0: torch.compile's Inductor wrapper has no __wrapped__, so inspect.unwrap ends on "
       "it with or without the stop predicate (which guards against a later torch wrapping it further)"
       for i in (4, 6, 7)},
    "roundalign.numerics.patch.x__qk_norm_rope__mutmut_32":
        "equivalent: getattr's default None for False; both are falsy",
    **{f"roundalign.numerics.patch.x__set_sum_orders__mutmut_{i}":
       "equivalent: the message's ', q, k' test separates 2L+1 norms (Qwen2) from 4L+1 (Qwen3); 3L+1 or 2L+2 as "
       "the threshold separates them as well for every L >= 1" for i in (26, 27)},
    **{f"roundalign.numerics.patch.x_apply_alignment__mutmut_{i}":
       "equivalent: getattr's default for hidden_act never applies: Qwen2Config and Qwen3Config define hidden_act "
       "as a class default (transformers 5.17.0), so every Qwen config has one" for i in (19, 22, 25, 26)},
    "roundalign.numerics.patch.x_apply_alignment__mutmut_50":
        "equivalent: the kernels recorded on a decoder layer are never read: its forward adds the residual sums with "
        "plain torch ops, and its norms, attention and MLP carry (and read) their own",
    "roundalign.numerics.patch.x_apply_alignment__mutmut_88":
        "equivalent: the aligned MLP reads no plan (it is installed only when the plan fuses SwiGLU, and always runs "
        "the fused kernel)",
    **{f"roundalign.numerics.patch.xǁ_AlignedDecoderLayerǁforward__mutmut_{i}":
       "equivalent: in an fp32 model the layer's mode only has to differ from 'fp32', 'fp32-stream' and 'fp32-read' "
       "(any such string runs the bf16 path); the one other use joins the incoming low part, which is None there: "
       "nothing writes the carrier slot when the mode is none of the fp32 modes" for i in (12, 13)},
    **{f"roundalign.numerics.patch.xǁ_AlignedDecoderLayerǁforward__mutmut_{i}":
       "equivalent: joining the incoming low part in residual mode 'bf16' as well: it is None there, since only "
       "the fp32 residual modes write the carrier slot (_split_fp32)" for i in (20, 22, 23)},
    **{f"roundalign.numerics.patch.xǁ_AlignedRMSNormǁforward__mutmut_{i}":
       "equivalent: taking the carrier slot's low part in residual mode 'bf16' as well: only the fp32 residual modes "
       "write the slot (_split_fp32), so it is empty and _take_lo returns None" for i in (53, 59, 60)},
    "roundalign.numerics.patch.xǁ_AlignedRMSNormǁforward__mutmut_11":
        "equivalent: passing sum_order=None when the norm has no order: None is every region's default order",
    "roundalign.numerics.patch.xǁ_AlignedRMSNormǁforward__mutmut_50":
        "equivalent: the bf16-sum add (residual 'bf16', vllm-eager) never has a reduction order: _set_sum_orders "
        "sets one only under vllm-cpu-compiled (residual 'fp32-stream') and refuses every other engine",
    **{f"roundalign.numerics.patch.x_decoder_trunk__mutmut_{i}":
       "equivalent: a bare Qwen*Model's base_model is the model itself, so taking base_model for every supported "
       "class returns the same trunk" for i in (12, 15, 16, 17)},
})

# Untested mutants ("no tests": no selected fast test reaches their function), by function pattern, with the reason.
NO_TESTS_EXPLAINED: dict[str, str] = {}


def _status_by_exit_code():
    from mutmut.stats import status_by_exit_code  # noqa: PLC0415 -- optional: mutmut

    return status_by_exit_code


def _explanation(name: str, table: dict[str, str]) -> str | None:
    if name in table:
        return table[name]
    for pattern, why in table.items():
        if any(c in pattern for c in "*?[") and fnmatch.fnmatchcase(name, pattern):
            return why
    return None


def _diff_line(name: str) -> str:
    """The mutated line as mutmut shows it (``mutmut show``), '-old / +new', shortened."""
    try:
        out = subprocess.run([str(Path(sys.executable).parent / "mutmut"), "show", name], cwd=ROOT,
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    minus = [ln[1:].strip() for ln in out.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    plus = [ln[1:].strip() for ln in out.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    short = lambda s: s if len(s) <= 100 else s[:97] + "..."  # noqa: E731
    return f"- {short(' '.join(minus))} / + {short(' '.join(plus))}"


def _git_sha() -> str:
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return sha + ("+dirty" if dirty else "")


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/bench/mutation.txt")
    ap.add_argument("--wall-s", type=float, default=None, help="wall time of the mutmut run (make mutation passes it)")
    ap.add_argument("--recheck-wall-s", type=float, default=None, help="wall time of tier 2 (make mutation passes it)")
    ap.add_argument("--mutants", default="mutants")
    ap.add_argument("--note", action="append", default=[], help="a line to record under the header (e.g. a run cut short)")
    args = ap.parse_args(argv)

    S = _status_by_exit_code()
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    mutants_dir = ROOT / args.mutants
    metas = sorted(mutants_dir.rglob("*.py.meta"))
    if not metas:
        print(f"mutation_report: no mutmut results under {mutants_dir} (run `make mutation`)", file=sys.stderr)
        return 2
    stats = json.loads((mutants_dir / "mutmut-stats.json").read_text())
    n_tests = len(stats.get("duration_by_test", {}))

    status: dict[str, str] = {}
    per_file: dict[str, Counter] = {}
    for meta in metas:
        rel = str(meta.relative_to(mutants_dir))[: -len(".meta")]
        data = json.loads(meta.read_text())
        c = Counter()
        for name, code in data["exit_code_by_key"].items():
            st = S[code]
            st = "killed" if st == "segfault" else st
            status[name] = st
            c[st] += 1
        if c:
            per_file[rel] = c
    recheck_path = mutants_dir / "recheck.json"
    recheck = json.loads(recheck_path.read_text()) if recheck_path.exists() else {}
    # the recheck's reader of mutmut's verdicts, with each function's source hash
    alive = alive_mutants(mutants_dir)
    tier2 = Counter()
    not_rechecked = []
    for name, st in list(status.items()):
        r = recheck.get(name)
        if st not in ("survived", "no tests"):
            continue
        if r is None or r.get("hash") != alive[name][1]:
            not_rechecked.append(name)
            continue
        tier2["rechecked"] += 1
        if r["verdict"] in ("killed", "survived"):
            status[name] = r["verdict"]
            tier2[r["verdict"]] += 1
            rel = "src/" + name.rsplit(".", 1)[0].replace(".", "/") + ".py"
            rel = rel if rel in per_file else rel[:-3] + "/__init__.py"
            per_file[rel][st] -= 1
            per_file[rel][r["verdict"]] += 1
            if r["verdict"] == "killed":
                per_file[rel]["killed in tier 2"] += 1
    total = len(status)
    counts = Counter(status.values())
    killed = counts["killed"]

    survivors = sorted(n for n, s in status.items() if s == "survived")
    untested = sorted(n for n, s in status.items() if s == "no tests")
    others = sorted(n for n, s in status.items() if s not in ("killed", "survived", "no tests"))
    unexplained = [n for n in survivors if _explanation(n, EXPLAINED) is None]
    unexplained += [n for n in untested if _explanation(n, NO_TESTS_EXPLAINED) is None]

    sel = cfg.get("pytest_add_cli_args_test_selection", [])
    lines = [
        f"# mutation testing (make mutation), {datetime.date.today().isoformat()}, git {_git_sha()}",
        f"# CPU: {_cpu()} ({platform.machine()}), Python {platform.python_version()}, mutmut {version('mutmut')}, "
        f"one child process (--max-children 1), OMP_NUM_THREADS=1",
        f"# mutated: {', '.join(cfg.get('only_mutate', []))}; not mutated: {', '.join(cfg.get('do_not_mutate', []))} "
        f"(reasons in pyproject.toml [tool.mutmut])",
        f"# tier 1, mutmut: {' '.join(sel)} ({n_tests} tests collected); each mutant runs the selected tests that "
        f"reached its function while mutmut collected stats",
        f"# tier 2, tools/mutation/recheck.py: each mutant tier 1 left alive reruns alone in a fresh process against "
        f"the slow tests of its file (RECHECK there): {tier2['rechecked']} rechecked, {tier2['killed']} killed, "
        f"{tier2['survived']} survived",
        f"# wall time of tier 1: {args.wall_s:.0f} s ({args.wall_s / 60:.1f} min)" if args.wall_s is not None
        else "# wall time of tier 1: not measured (run through `make mutation`)",
        f"# wall time of tier 2: {args.recheck_wall_s:.0f} s ({args.recheck_wall_s / 60:.1f} min)"
        if args.recheck_wall_s is not None else "# wall time of tier 2: not measured (run through `make mutation`)",
        *(f"# NOTE: {n}" for n in args.note),
        "",
        f"total {total}  killed {killed}  survived {counts['survived']}  timeout {counts['timeout']}  "
        f"suspicious {counts['suspicious']}  no-tests {counts['no tests']}  not-checked {counts['not checked']}",
        f"score = killed / total = {killed}/{total} = {killed / total:.3f}",
        "",
        "per file:                                     total  killed (tier 2)  survived  no-tests  other",
    ]
    for rel, c in per_file.items():
        other = sum(v for k, v in c.items() if k not in ("killed", "survived", "no tests", "killed in tier 2"))
        n = sum(v for k, v in c.items() if k != "killed in tier 2")
        lines.append(f"  {rel:<44} {n:5d}  {c['killed']:6d} ({c['killed in tier 2']:4d})  {c['survived']:8d}  "
                     f"{c['no tests']:8d}  {other:5d}")
    lines += ["", f"survivors ({len(survivors)}), each with why it lives:"]
    for n in survivors:
        why = _explanation(n, EXPLAINED) or "UNEXPLAINED: kill it with a test or explain it in tools/mutation/report.py"
        lines.append(f"  {n}: {why}")
        lines.append(f"      {_diff_line(n)}")
    if untested:
        lines += ["", f"no tests ({len(untested)}): no selected fast test reaches the function"]
        by_fn = Counter(n.rsplit("__mutmut_", 1)[0] for n in untested)
        for fn, k in sorted(by_fn.items()):
            why = _explanation(f"{fn}__mutmut_1", NO_TESTS_EXPLAINED) or "UNEXPLAINED"
            lines.append(f"  {fn} ({k} mutants): {why}")
    if others:
        lines += ["", f"timeout / suspicious / not checked ({len(others)}), by function:"]
        for (fn, st), k in sorted(Counter((n.rsplit("__mutmut_", 1)[0], status[n]) for n in others).items()):
            lines.append(f"  {fn}: {k} {st}")
    if not_rechecked:
        lines += ["", f"not rechecked by tier 2 ({len(not_rechecked)}; tier 1's verdict stands), by function:"]
        for fn, k in sorted(Counter(n.rsplit("__mutmut_", 1)[0] for n in not_rechecked).items()):
            lines.append(f"  {fn}: {k}")
    lines += ["", f"unexplained: {len(unexplained)}" + ("" if not unexplained else " (make mutation fails)")]
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:9]))
    print(f"mutation_report: wrote {args.out}; {len(unexplained)} unexplained")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
