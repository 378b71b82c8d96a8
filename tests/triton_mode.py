"""How the Triton kernels run in the tests that use them: compiled on CUDA tensors where there is a CUDA GPU
(and ``TRITON_INTERPRET`` is not 1), else through Triton's interpreter on CPU tensors. Importing this
module imports triton and the kernels in that mode; a test module imports from here, then skips itself when
:data:`SKIP_REASON` is set. :func:`q` and :func:`amax` run the kernels on :data:`DEVICE` and bring the
results back to the CPU."""
import os
import subprocess
import sys

import pytest
import torch

from snip_ds.quant import QuantParts


def _set_interpret(value):
    """Set TRITON_INTERPRET to ``value`` (None: unset); returns the previous value."""
    previous = os.environ.get("TRITON_INTERPRET")
    if value is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = value
    return previous


# Compiled kernels on a CUDA GPU; else Triton's interpreter on CPU tensors. Triton decides interpreted vs
# compiled when a function is defined (its own library functions when triton is imported, ours when the
# kernels module is), and imports some modules lazily during a call: so for the interpreter the variable is
# set while triton and the kernels are imported and while this module's tests run, and nowhere else.
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1" else "cpu"
_previous = _set_interpret("1") if DEVICE == "cpu" else os.environ.get("TRITON_INTERPRET")
try:
    pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")
    from triton.language import random as triton_random
    from triton.runtime.interpreter import InterpretedFunction
    from snip_ds.backend.kernels import quantize as kq
    from snip_ds.backend.kernels import grouped as kg  # (its kernels call kq's device functions: the same mode)
finally:
    _set_interpret(_previous)
SKIP_REASON = None
if DEVICE == "cpu" and not (kq.INTERPRETED and isinstance(triton_random.randint, InterpretedFunction)):
    SKIP_REASON = ("triton was imported earlier in this process without its interpreter; run this file in a "
                   "process of its own")
if DEVICE == "cuda" and kq.INTERPRETED:
    SKIP_REASON = ("triton was imported earlier in this process with TRITON_INTERPRET=1: the kernels would not "
                   "be the compiled ones; run this file in a process of its own")
on_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="compiled kernels on a CUDA GPU")


@pytest.fixture(autouse=True, scope="module")
def interpreter_on():
    previous = _set_interpret("1") if DEVICE == "cpu" else None
    yield
    if DEVICE == "cpu":
        _set_interpret(previous)


def q(x, recipe, axis=-1, **kw) -> QuantParts:
    """:func:`kq.quantize_parts` on the kernels' device; the result back on the CPU."""
    if isinstance(x, torch.Tensor):
        x = x.to(DEVICE)
    for name in ("tensor_amax", "seed"):
        if isinstance(kw.get(name), torch.Tensor):
            kw[name] = kw[name].to(DEVICE)
    parts = kq.quantize_parts(x, recipe, axis, **kw)
    return QuantParts(parts.values.cpu(), parts.tensor_scale.cpu())


def amax(x) -> torch.Tensor:
    """:func:`kq.tensor_amax` on the kernels' device, back on the CPU."""
    return kq.tensor_amax(x.to(DEVICE)).cpu()




@pytest.fixture
def through_kernels(monkeypatch):
    """The torch backend (returned) quantizing with the Triton kernels on DEVICE (on a CPU: the interpreted
    kernels)."""
    from snip_ds.backend import TorchBackend, kernels, torch_native

    if DEVICE == "cpu":
        monkeypatch.setattr(torch_native, "KERNEL_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(torch_native, "_kernels_checked", False)
    monkeypatch.setattr(torch_native, "_kernels_module", None)
    assert torch_native.kernels() is kernels  # the real kernels, in the mode DEVICE says
    assert kernels.interpreting() == (DEVICE == "cpu")
    return TorchBackend()


def compile_check(script: str, timeout: int) -> None:
    """Runs ``script`` (``python -c``) in a subprocess where Triton is not in interpreter mode, with the repository
    on its path: it compiles kernels for a GPU without one and prints ``ok``, or ``skip: <why>`` where Triton's
    CUDA backend is not installed (the test skips)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "0")  # silences a warning; the kernels have no a * b + c to fuse
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    if result.stdout.startswith("skip:"):
        pytest.skip(f"Triton's CUDA backend is not installed ({result.stdout.strip()})")
    assert result.stdout.strip().endswith("ok")
