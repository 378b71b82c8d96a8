"""How snip_ds launches its compiled Triton kernels: directly in eager mode, through ``torch.library.wrap_triton``
while a trace is on.

An eager launch through ``wrap_triton`` dispatches its higher-order operator (every argument flattened): about
55-120 µs of host time a launch here against Triton's own 6-19 µs (bench_layer_host's ``triton_launch_us``), the
largest part of an FP8 layer step's host time on a GPU. A trace must still see the launch as that operator: dynamo,
and AOTAutograd and inductor tracing a ``triton_op``'s body with fake and functional tensors, where launching the
kernel itself would read a fake tensor's data pointer. In a subprocess, where Triton is not in interpreter mode
(no GPU needed: nothing is launched).
"""
from triton_mode import compile_check

LAUNCH_PATH = r"""
import sys
try:
    import triton.backends.nvidia  # noqa: F401
except ImportError as err:
    print("skip:", err)
    sys.exit(0)
from unittest import mock
import torch
from torch._higher_order_ops.triton_kernel_wrap import TraceableTritonKernelWrapper
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from snip_ds.backend.kernels import direct, quantize as kq

assert not kq.INTERPRETED
kernel = kq._amax_kernel
assert kq.launchable(kernel) is direct.launcher(kernel), "eager: its direct launcher (the kernel, unsupported)"
assert direct.launcher(kernel) is kernel or direct.launcher(kernel).kernel is kernel
with FakeTensorMode():
    assert isinstance(kq.launchable(kernel), TraceableTritonKernelWrapper), "fake tensors: wrap_triton"
with mock.patch.object(torch.compiler, "is_compiling", lambda: True):
    assert isinstance(kq.launchable(kernel), TraceableTritonKernelWrapper), "dynamo: wrap_triton"

# the triton_ops' bodies traced as AOTAutograd traces them: each launch is wrap_triton's operator in the graph
x = torch.randn(40, 64)
for fn in (kq.triton_amax, lambda x: kq.triton_quantize(x, None, None, "fp8_e4m3", -1, 0, torch.float8_e4m3fn,
                                                         False, False)):
    graph = make_fx(fn, tracing_mode="fake", pre_dispatch=False)(x).graph
    targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert any("snip_ds" in t or "triton_kernel_wrapper" in t for t in targets), targets
print("ok")
"""


def test_eager_launches_skip_wrap_triton_and_traces_keep_it():
    """Eager: ``launchable`` hands back the kernel's direct launcher (snip_ds.backend.kernels.direct); under
    fake tensors and dynamo, ``wrap_triton``'s wrapper; the ``snip_ds::triton_*`` ops trace under ``make_fx``
    with fake tensors (a raw launch there would fail on the fake tensors' data pointers)."""
    compile_check(LAUNCH_PATH, timeout=300)
