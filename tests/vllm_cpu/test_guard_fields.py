"""The vLLM classes (0.31.0; 0.32.0 in .venv-vllm032) still have every field the guard reads (run where vLLM is installed: its CPU build)."""

import inspect

import pytest

from roundalign.bridge import vllm_guard as G

pytestmark = pytest.mark.vllm032


def test_real_vllm_classes_have_the_fields_the_guard_reads():
    from vllm.config import CompilationConfig, KernelConfig, ParallelConfig, VllmConfig  # noqa: PLC0415 -- optional: vllm
    from vllm.config.compilation import CompilationMode, CUDAGraphMode, PassConfig  # noqa: PLC0415 -- optional: vllm
    from vllm.config.device import DeviceConfig  # noqa: PLC0415 -- optional: vllm
    from vllm.config.kernel import IrOpPriorityConfig  # noqa: PLC0415 -- optional: vllm
    from vllm.config.model import ModelConfig  # noqa: PLC0415 -- optional: vllm
    from vllm.entrypoints.llm import LLM  # noqa: PLC0415 -- optional: vllm

    def fields(cls):
        return set(getattr(cls, "__dataclass_fields__", {})) | set(getattr(cls, "model_fields", {}))

    assert {"compilation_config", "kernel_config", "parallel_config", "model_config"} <= fields(VllmConfig)
    assert {"mode", "backend", "cudagraph_mode", "custom_ops", "use_inductor_graph_partition",
            "pass_config"} <= fields(CompilationConfig)
    import vllm  # noqa: PLC0415 -- optional: vllm

    assert set(G.pass_fields(vllm.__version__)) <= fields(PassConfig)
    assert {"rms_norm", "fused_add_rms_norm"} <= fields(IrOpPriorityConfig)
    assert "ir_op_priority" in fields(KernelConfig) and "tensor_parallel_size" in fields(ParallelConfig)
    assert {"enforce_eager", "dtype"} <= fields(ModelConfig)
    assert CompilationMode.VLLM_COMPILE == G.VLLM_COMPILE and CompilationMode.NONE == G.COMPILE_NONE
    assert CompilationMode.DYNAMO_TRACE_ONCE == G.DYNAMO_TRACE_ONCE
    assert "device_type" in fields(DeviceConfig) and "splitting_ops" in fields(CompilationConfig)
    assert CUDAGraphMode.NONE.name == "NONE"
    assert "self.llm_engine" in inspect.getsource(LLM.__init__)
