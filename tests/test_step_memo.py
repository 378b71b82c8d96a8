"""A layer finds its decided step once (snip_ds.backend.layer_step.StepMemo), not by asking the backends at every
call, and decides again exactly when what the step was decided from changes: its precision, its config, the
input's shape, dtype or device, the backend registry or the torch backend's device and kernel settings. A copied or
pickled layer starts without a memo's answer. Calls are counted, not timed."""
import copy
import pickle

import pytest
import torch

from snip_ds.backend import base, layer_step, torch_native
from snip_ds.backend.torch_native import TorchBackend
from snip_ds.linear import SnipLinear
from snip_ds.quant_config import QuantConfig
from triton_mode import DEVICE, SKIP_REASON, interpreter_on, through_kernels  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


@pytest.fixture
def decisions(through_kernels, monkeypatch):
    """The torch backend's decisions of a step, counted (``fp8``: the per-tensor FP8 step asked; ``block``:
    the block-scaled step asked)."""
    counts = {"fp8": 0, "block": 0}
    for name, key in (("decided_fp8_step", "fp8"), ("decided_block_step", "block")):
        original = getattr(TorchBackend, name)

        def counted(self, *args, _original=original, _key=key, **kwargs):
            counts[_key] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(TorchBackend, name, counted)
    return counts


def _layer(precision="fp8", **fields):
    torch.manual_seed(0)
    return SnipLinear(64, 48, bias=False, device=DEVICE, precision=precision,
                      quant_config=QuantConfig(backend="torch", **fields))


def _step(layer, x):
    layer(x.detach().requires_grad_(True)).sum().backward()
    layer.weight.grad = None


def _node(layer, x) -> str:
    return type(layer(x).grad_fn).__name__  # (not grad_fn.name(): torch 2.11 has none for a Python function's node)


@pytest.mark.parametrize("precision,fields,asked", [("fp8", {}, {"fp8": 1, "block": 0}),
                                                    ("fp4", {}, {"fp8": 1, "block": 1}),
                                                    ("fp8", {"fp8_recipe": "mxfp8"}, {"fp8": 1, "block": 1})])
def test_a_layer_decides_its_step_once_for_many_calls(decisions, precision, fields, asked):
    layer = _layer(precision, **fields)
    x = torch.randn(32, 64, device=DEVICE)
    for _ in range(4):
        _step(layer, x)
    assert decisions == asked
    assert layer.step_memo.step is layer_step.decided_step(x, layer.weight, layer.gemm_precision,
                                                           layer.quant_config)


def test_what_the_step_is_decided_from_decides_it_again(decisions, monkeypatch):
    """Each change below is one new decision, and the memo then holds the step asked without a memo."""
    layer = _layer()
    x = torch.randn(32, 64, device=DEVICE)
    _step(layer, x)
    asked = 1

    def decided_again(x_now):
        nonlocal asked
        _step(layer, x_now)
        _step(layer, x_now)
        asked += 1
        assert decisions["fp8"] == asked
        fresh = layer_step.decided_step(x_now, layer.weight, layer.gemm_precision, layer.quant_config)
        asked += 1  # (the fresh answer above asked too)
        assert layer.step_memo.step is fresh

    layer.precision = "fp4"  # a re-plan
    decided_again(x)
    layer.precision = "fp8"
    decided_again(x)
    layer.quant_config = QuantConfig(backend="torch")  # an equal config: the same answer, not asked again
    _step(layer, x)
    assert decisions["fp8"] == asked
    layer.quant_config = QuantConfig(backend="torch", fp4_recipe="mxfp4")  # another config (the same FP8 step)
    decided_again(x)
    decided_again(torch.randn(16, 64, device=DEVICE))  # another shape
    decided_again(torch.randn(2, 16, 64, device=DEVICE))  # the same tokens, 3-D
    decided_again(torch.randn(16, 64, device=DEVICE).bfloat16())  # another dtype
    monkeypatch.setattr(torch_native, "SCALED_MM_DEVICES", ("cpu", "cuda"))  # the backend's settings
    decided_again(x)
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))  # (the registry restored after the test)
    base.register(TorchBackend())  # a backend registered anew (the layer's backends resolved again)
    decided_again(x)


def test_another_device_decides_again(decisions):
    """The same shapes on another device are not answered from the memo: asked again, the torch backend refuses
    a device it cannot run on (here ``meta``), where a memo keyed without the device would hand back the step."""
    layer = _layer()
    x = torch.randn(32, 64, device=DEVICE)
    _step(layer, x)
    with pytest.raises(base.BackendError):
        layer_step.decided_step(x.to("meta"), layer.weight, layer.gemm_precision, layer.quant_config,
                                layer.step_memo)


def test_a_re_plan_to_bf16_and_back_runs_the_right_function(decisions):
    layer = _layer()
    x = torch.randn(32, 64, device=DEVICE, requires_grad=True)
    assert _node(layer, x) == "DecidedStepFnBackward"
    layer.precision = {"fprop": "fp8", "dgrad": "fp8", "wgrad": "fp4"}  # no decided step: the general function
    assert _node(layer, x) == "QuantizedLinearFnBackward"
    assert _node(layer, x) == "QuantizedLinearFnBackward"
    layer.precision = "bf16"
    assert _node(layer, x) != "DecidedStepFnBackward"
    layer.precision = "fp8"
    assert _node(layer, x) == "DecidedStepFnBackward"


def test_a_tensor_parallel_reduction_never_takes_the_memo(decisions):
    """Under a shared_amax reduction the layer runs the general function (its amaxes the whole tensor's), whatever
    its memo holds."""
    from snip_ds.backend.operands import shared_amax

    layer = _layer()
    x = torch.randn(32, 64, device=DEVICE, requires_grad=True)
    assert _node(layer, x) == "DecidedStepFnBackward"
    with shared_amax(lambda amax: amax):
        assert _node(layer, x) == "QuantizedLinearFnBackward"
    assert _node(layer, x) == "DecidedStepFnBackward"


def test_a_copied_or_pickled_layer_starts_with_an_empty_memo(decisions):
    layer = _layer()
    x = torch.randn(32, 64, device=DEVICE)
    _step(layer, x)
    assert layer.step_memo.step is not None
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert other.step_memo is not layer.step_memo and other.step_memo.key is None
        asked = decisions["fp8"]
        _step(other, x)
        assert decisions["fp8"] == asked + 1 and other.step_memo.step is not None
