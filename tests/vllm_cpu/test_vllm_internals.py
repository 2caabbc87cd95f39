"""Every private vLLM path roundalign reaches (roundalign.bridge.vllm_internals) resolves on a real built engine of the
pinned vLLM 0.31.0 (its CPU build), and the module is the only place in the package that spells them."""

import io
import tokenize
from pathlib import Path

import pytest
import torch

from roundalign.bridge import vllm_internals as VI
from roundalign.models.tiny import random_qwen

pytestmark = pytest.mark.vllm032  # also run in .venv-vllm032 (vLLM 0.32.0)

SRC = Path(__file__).resolve().parents[2] / "src" / "roundalign"


@pytest.mark.parametrize("eager", [False, True])
def test_every_path_resolves_on_a_built_engine(tmp_path, eager):
    from vllm import LLM  # noqa: PLC0415 -- optional: vllm

    random_qwen("qwen2", hidden=128, heads=4, kv_heads=2, layers=1, vocab=256).save_pretrained(tmp_path / "m")
    llm = LLM(model=str(tmp_path / "m"), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=eager, seed=0,
              max_model_len=128, max_num_seqs=2)
    try:
        class Generation:  # TRL's VLLMGeneration holds the LLM as .llm
            pass

        gen = Generation()
        gen.llm = llm
        trainer = type("Trainer", (), {"vllm_generation": gen})()
        assert VI.unwrap_llm(gen) is llm and VI.colocated_llm(trainer) is llm
        assert VI.colocated_llm(object()) is None
        cfg = VI.vllm_config(gen)
        assert type(cfg).__name__ == "VllmConfig" and cfg.model_config.enforce_eager == eager
        model = VI.inprocess_model(llm)
        assert isinstance(model, torch.nn.Module) and type(model).__name__ == "Qwen2ForCausalLM", type(model)
        assert hasattr(VI.engine_core(llm), "shutdown")
        cache = VI.compile_cache_dir(llm)
        if eager:
            assert cache is None
        else:
            assert cache.is_dir() and "torch_compile_cache" in cache.parts, cache
        assert callable(VI.cpu_gemm_utils().dispatch_cpu_unquantized_gemm)
    finally:
        del llm


def test_no_other_module_spells_a_private_vllm_path():
    """Attribute accesses in code (tokens, not strings or comments) of vLLM's private objects, outside
    vllm_internals: a second spelling of a path would drift on its own when vLLM moves it."""
    private = {"llm_engine", "driver_worker", "model_runner", "engine_core", "local_cache_dir"}
    offenders = []
    for f in sorted(SRC.rglob("*.py")):
        if f.name == "vllm_internals.py":
            continue
        toks = [t for t in tokenize.generate_tokens(io.StringIO(f.read_text()).readline)
                if t.type in (tokenize.NAME, tokenize.OP)]
        for a, b, c in zip(toks, toks[1:], toks[2:]):
            if a.string == "." and b.type == tokenize.NAME and b.string in private:
                offenders.append(f"{f.relative_to(SRC)}:{b.start[0]}: .{b.string}")
            if (a.string, b.string, c.string) == ("vllm_generation", ".", "llm"):
                offenders.append(f"{f.relative_to(SRC)}:{a.start[0]}: vllm_generation.llm")
            if (a.string, b.string, c.string) == ("layers", "import", "utils"):
                offenders.append(f"{f.relative_to(SRC)}:{a.start[0]}: model_executor.layers.utils")
    assert offenders == [], "\n".join(offenders)
