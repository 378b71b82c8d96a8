"""No host synchronisation inside a quantized layer's step: a SnipLinear forward and backward reads no tensor's
value on the host, for every backend that runs on a CPU and every recipe.

On a CPU such a read waits for nothing, so it would go unseen; snip_ds.backend.dispatch_audit.HostReads records
it where it is made (a Python-level ``item``/``int``/``bool``/``tolist``/``cpu``, an ``aten::_local_scalar_dense``,
a value-dependent operator such as ``nonzero``, a copy from a device to the host). The first tests hold the
detector to reads it must see, so that a read that comes back into the layer fails the last test. The
Triton kernels' path (what runs on CUDA) is checked under the interpreter in tests/test_compile_kernels.py.
"""
import pytest
import torch

from snip_ds.backend import base
from snip_ds.backend import cpu as cpu_kernels
from snip_ds.backend.dispatch_audit import HostReads, OpCounter
from snip_ds.linear import SnipLinear
from snip_ds.quant_config import QuantConfig

CASES = {
    "fp8_hybrid": ("fp8", {}),
    "mxfp8": ("fp8", {"fp8_recipe": "mxfp8"}),
    "nvfp4_sr": ("fp4", {}),
    "mxfp4_hadamard_sr": ("fp4", {"fp4_recipe": "mxfp4", "hadamard": True}),
    "per_gemm": ({"fprop": "fp8", "dgrad": "fp4", "wgrad": "bf16"}, {}),
}


@pytest.mark.parametrize("read", ["int", "item", "bool", "float", "tolist", "numpy", "nonzero", "mask",
                                  "condition", "seed_offset"])
def test_the_detector_sees_every_kind_of_host_read(read):
    t = torch.randn(6)
    run = {"int": lambda: int(t[0]), "item": lambda: t[1].item(), "bool": lambda: bool(t[0] > 0),
           "float": lambda: float(t.sum()), "tolist": t.tolist, "numpy": t.numpy, "nonzero": lambda: t.nonzero(),
           "mask": lambda: t[t > 0], "condition": lambda: 1 if (t > 0).any() else 0,
           "seed_offset": lambda: base.seed_offset(None)}[read]  # the kernels' seed as an int: a read
    with HostReads() as audit:
        run()
    assert audit.reads


def test_the_detector_passes_device_work_and_counts_operators():
    t = torch.randn(8, 4)
    with HostReads() as audit, OpCounter() as counter:
        y = (t * 2).sum(0).reshape(2, 2).t()
        torch.randint(0, 2 ** 62, (), generator=torch.Generator().manual_seed(1))  # a seed kept as a tensor
    assert not audit.reads and y.shape == (2, 2)
    assert counter.counts.kernels == {"aten::mul": 1, "aten::sum": 1, "aten::randint": 1}
    assert sum(counter.counts.views.values()) == 2  # reshape's view, t


@pytest.mark.parametrize("backend", ["emulated", "torch_cpu_kernels", "torch_plain", "auto"])
@pytest.mark.parametrize("case", CASES)
def test_a_layer_step_reads_nothing_on_the_host(monkeypatch, case, backend):
    if backend == "torch_cpu_kernels" and not cpu_kernels.available():
        pytest.skip(f"the CPU kernels did not build: {cpu_kernels.unavailable_reason()}")
    if backend == "torch_plain":
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    precision, fields = CASES[case]
    layer = SnipLinear(72, 40, precision=precision,
                       quant_config=QuantConfig(backend=backend.split("_")[0], **fields))
    layer.generator = torch.Generator().manual_seed(0)
    x, g = torch.randn(2, 30, 72, requires_grad=True), torch.randn(2, 30, 40)
    layer(x).backward(g)  # the first step: one-off set-up (kernel builds, resolved backends)
    with HostReads() as audit:
        layer(x).backward(g)
    assert not audit.reads, "\n".join(map(str, audit.reads))
