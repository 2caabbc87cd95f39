"""A CPU platform for verl 0.9.1, registered as ``cpu``: test scaffolding, so that verl's own FSDP engine and worker
run on a machine without an accelerator.

verl ships none (``verl/plugin/platform`` has CUDA, NPU and ROCm; ``platform_manager._detect_platform_name`` falls
back to ``nvidia`` and the backend ``nccl``). This one is CUDA's record with the device ``cpu``, the backend
``gloo`` and zero memory statistics. It lives beside the tests, not in the package: verl on CPU runs its engine and
worker but none of its rollouts (vLLM/SGLang servers) and no trainer end to end, so no user runs verl this way; the
tests use it to drive verl's real actor path. verl resolves its platform once per process, on the first
``get_platform()`` (``verl.workers.engine.fsdp.transformer_impl`` asks at import), so import this module and set
``VERL_PLATFORM=cpu`` before anything else from verl (``conftest.py`` does both).
"""

import contextlib

import torch
from verl.plugin.platform.platform_cuda import PlatformCUDA
from verl.plugin.platform.platform_manager import PlatformRegistry


class _CPUDeviceModule:
    """``torch.cpu`` plus the memory-statistics calls verl makes on ``get_torch_device()`` (zeros: a CPU process
    has no separate device memory to report)."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def max_memory_allocated(self, *args, **kwargs):
        return 0

    def max_memory_reserved(self, *args, **kwargs):
        return 0

    def memory_allocated(self, *args, **kwargs):
        return 0

    def memory_reserved(self, *args, **kwargs):
        return 0

    def reset_peak_memory_stats(self, *args, **kwargs):
        pass

    def empty_cache(self):
        pass

    def mem_get_info(self, *args, **kwargs):
        return (0, 0)

    def get_device_name(self, *args, **kwargs):
        return "CPU"


_CPU_MODULE = _CPUDeviceModule()


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformCUDA):
    @property
    def device_name(self):
        return "cpu"

    @property
    def vendor_name(self):
        return "cpu"

    @property
    def device_module(self):
        return _CPU_MODULE

    def is_available(self):
        return True

    def is_platform_available(self, use_smi_check=False):
        return True

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return (None, None)

    def communication_backend_name(self):
        return "gloo"

    def is_ipc_supported(self):
        return False

    def nvtx_range(self, msg):
        return contextlib.nullcontext()

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_resource_options(self, num_gpus):
        return {"num_cpus": num_gpus}
