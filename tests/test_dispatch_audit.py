"""snip_ds.backend.dispatch_audit's counter looks inside tensor subclasses and counts copies as kernels: a
hand-written wrapper subclass whose mm runs two operators, torchao's Float8TrainingTensor, and the
operators whose schema says "alias" but which copy (``aten::contiguous``) or say nothing but only alias
(``aten::_unsafe_view``)."""
import pytest
import torch
import torch.utils._pytree as pytree

from snip_ds.backend.dispatch_audit import HostReads, OpCounter, runs_kernel


class Scaled(torch.Tensor):
    """A wrapper subclass: an inner tensor and a scale; ``mm`` of two runs two operators on the inner
    tensors (the product, then the scale), ``t`` returns a wrapper of the transposed inner tensor; an
    ``item_scale`` wrapper reads its scale on the host inside its mm."""

    @staticmethod
    def __new__(cls, inner, scale, read_scale=False):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner, scale, read_scale=False):
        self.inner, self.scale, self.read_scale = inner, scale, read_scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            a, b = args
            if a.read_scale:
                float(a.scale)  # a host read inside the subclass
            return torch.mm(a.inner.contiguous(), b.inner) * (a.scale * b.scale)
        if func is torch.ops.aten.t.default:
            return Scaled(args[0].inner.t(), args[0].scale, args[0].read_scale)
        unwrapped = pytree.tree_map_only(Scaled, lambda s: s.inner * s.scale, (args, kwargs or {}))
        return func(*unwrapped[0], **unwrapped[1])


def test_the_counter_sees_the_operators_a_subclass_runs():
    a = Scaled(torch.randn(8, 4), torch.tensor(2.0))
    b = Scaled(torch.randn(4, 6), torch.tensor(0.5))
    with OpCounter() as counter:
        y = torch.mm(a, b)
    assert torch.allclose(y, a.inner @ b.inner)
    # the product and two multiplies, on plain tensors; the mm on the subclass itself runs no kernel
    assert counter.counts.kernels == {"aten::mm": 1, "aten::mul": 2}
    assert counter.counts.subclass == {"aten::mm": 1}
    c = Scaled(torch.randn(8, 3), torch.tensor(1.0))
    with OpCounter() as counter:
        torch.mm(a.t(), c)  # a's inner tensor transposed: its contiguous() copies, and is counted
    assert counter.counts.kernels == {"aten::contiguous": 1, "aten::mm": 1, "aten::mul": 2}
    assert counter.counts.subclass == {"aten::t": 1, "aten::mm": 1}


def test_host_reads_inside_a_subclass_are_seen():
    a = Scaled(torch.randn(8, 4), torch.tensor(2.0), read_scale=True)
    b = Scaled(torch.randn(4, 6), torch.tensor(0.5))
    with HostReads() as audit:
        torch.mm(a, b)
    assert len(audit.reads) == 1 and audit.reads[0].what in ("aten::item", "aten::_local_scalar_dense")
    with HostReads() as audit:
        torch.mm(Scaled(a.inner, a.scale), b)
    assert not audit.reads


def test_contiguous_reshape_and_views_are_told_apart_by_what_they_did():
    contiguous = torch.ops.aten.contiguous.default
    t = torch.randn(4, 6)
    assert runs_kernel(contiguous, (t.t(),), {}, t.t().contiguous())  # a copy, though its schema says alias
    assert not runs_kernel(contiguous, (t,), {}, t)  # already contiguous: the input itself
    assert not runs_kernel(torch.ops.aten._unsafe_view.default, (t, [24]), {}, t.view(24))  # no annotation
    assert runs_kernel(torch.ops.aten.add_.Tensor, (t, t), {}, t)  # in place: writes its argument
    assert not runs_kernel(torch.ops.aten.empty.memory_format, ([3],), {}, torch.empty(3))
    with OpCounter() as counter:
        t.t().reshape(24)  # a copy (clone) and a view of it (_unsafe_view)
        t.reshape(3, 8)  # a view
        t.t().contiguous()
    assert counter.counts.kernels == {"aten::clone": 2}
    assert counter.counts.views == {"aten::t": 2, "aten::_unsafe_view": 1, "aten::view": 1}


def test_torchao_float8_is_counted_inside_its_tensor_subclass():
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = torch.nn.Sequential(torch.nn.Linear(32, 16, bias=False, dtype=torch.bfloat16))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(16, 16, dtype=torch.bfloat16)
    model(x).backward(g)
    model[0].weight.grad = None
    with OpCounter() as counter:
        model(x).backward(g)
    kernels = counter.counts.kernels
    # three FP8 GEMMs (fprop, dgrad, wgrad), no BF16 one; each operand scaled from its own amax
    assert kernels["aten::_scaled_mm"] == 3 and "aten::mm" not in kernels
    assert kernels["aten::abs"] == 6 and kernels["aten::max"] == 6
    assert counter.counts.subclass["aten::mm"] == 3
    assert counter.counts.launches == sum(kernels.values()) > 3 * 10


def test_a_profile_counts_what_the_counter_counts():
    from torch.profiler import ProfilerActivity, profile

    from snip_ds.backend.dispatch_audit import profiled_host_reads, profiled_kernels

    a, b = torch.randn(8, 4), torch.randn(4, 6)

    def work():
        y = torch.mm(a, b.t().contiguous().t())  # a copy, then a view of it
        y = y.reshape(48).reshape(6, 8) * 2  # views, one multiply
        y.t().contiguous().sum().item()  # a copy (clone), a sum and a host read
        return torch.zeros(3)

    with OpCounter() as counter:
        work()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        work()
    counted = profiled_kernels(prof.events())
    # copy, mm, mul, copy, sum, the scalar's copy to the host, the fill of zeros
    assert sum(counted.values()) == counter.counts.launches == 7
    assert counted == counter.counts.kernels
    assert profiled_host_reads(prof.events()) == {"aten::_local_scalar_dense": 1}


def test_live_bytes_counts_what_is_allocated_until_it_is_freed():
    from snip_ds.backend.dispatch_audit import LiveBytes

    x = torch.randn(256)  # 1 KiB, before the block: never counted
    with LiveBytes() as mem:
        y = x * 2  # 1 KiB
        v = y[:10].t()  # a view: nothing new
        y.mul_(3)  # in place: nothing new
        z = torch.cat([y, y])  # 2 KiB: 3 KiB live
        del y, z  # z freed; y's storage lives on in v
        w = torch.empty(64)  # 256 B
        assert mem.live == 1024 + 256
        del v, w
        assert mem.live == 0
    assert mem.peak == 3 * 1024
    a = Scaled(torch.randn(8, 4), torch.tensor(2.0))
    b = Scaled(torch.randn(4, 6), torch.tensor(0.5))
    with LiveBytes() as mem:
        y = torch.mm(a, b)  # inside the subclass: the product, a scale, the scaled product
    assert y.shape == (8, 6) and mem.live == 8 * 6 * 4 and mem.peak == 2 * 8 * 6 * 4 + 4


def test_a_profile_counts_an_operator_not_its_cpu_implementation():
    """The CPU's ``_scaled_mm`` casts and reads its scales on the host inside; a GPU runs one GEMM kernel."""
    from torch.profiler import ProfilerActivity, profile

    from snip_ds.backend.dispatch_audit import profiled_host_reads, profiled_kernels

    a = torch.randn(16, 16).to(torch.float8_e4m3fn)
    one = torch.ones(())
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"no CPU _scaled_mm here: {err}")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    assert profiled_kernels(prof.events()) == {"aten::_scaled_mm": 1}
    assert not profiled_host_reads(prof.events())
