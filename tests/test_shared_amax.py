"""``operands.shared_amax``: a shard of a tensor quantized inside it is scaled by the whole tensor's amax, in every
backend and GEMM, so the shards' GEMMs compute what the whole layer's do (the single-process counterpart of
tests/test_tensor_parallel.py; here the "all-reduce" is a table from each shard's own amax to the whole tensor's)."""
import pytest
import torch

from snip_ds.backend import get_backend
from snip_ds.backend.emulated import reference_operands
from snip_ds.backend.operands import amax_shared, shared_amax, tensor_amax, whole_amax
from snip_ds.quant_config import QuantConfig

U = 2.0 ** -24


def _table(pairs):
    """A reduction that maps each shard's own amax (by value) to its whole tensor's."""
    lookup = {}
    for whole, shards in pairs:
        for s in shards:
            lookup[float(s.abs().amax())] = whole.abs().amax()
    return lambda a: lookup[float(a)].to(a.device)


def _bound(gemm, a, b, prec, cfg, length):
    """``γ_{K+2} |Q(a)||Q(b)|``: the round-off of any order of the GEMM's FP32 sums (and its two scalings)."""
    qa, qb = (p.values * p.tensor_scale for p in reference_operands(gemm, a, b, prec, cfg))
    prod = {"fprop": lambda: qa.abs() @ qb.abs().t(), "dgrad": lambda: qa.abs() @ qb.abs(),
            "wgrad": lambda: qa.abs().t() @ qb.abs()}[gemm]()
    return (length + 2) * U / (1 - (length + 2) * U) * prod


@pytest.mark.parametrize("backend", ["emulated", "torch"])
@pytest.mark.parametrize("recipes", [("fp8_hybrid", "nvfp4"), ("mxfp8", "mxfp4")])
@pytest.mark.parametrize("prec", ["fp8", "fp4"])
def test_column_and_row_shards_compute_the_whole_layer(backend, recipes, prec):
    be = get_backend(backend)
    cfg = QuantConfig(fp8_recipe=recipes[0], fp4_recipe=recipes[1], stochastic_rounding=False)
    gen = torch.Generator().manual_seed(0)
    # shards of 64 (k) and 96 (n): whole blocks of every recipe (MX: 32)
    x, w, g = (torch.randn(*s, generator=gen) for s in ((64, 128), (192, 128), (64, 192)))
    full = {"fprop": be.fprop(x, w, prec, cfg), "dgrad": be.dgrad(g, w, prec, cfg), "wgrad": be.wgrad(g, x, prec, cfg)}
    # column shards: rows of W (and columns of G_Y); X whole
    w_s, g_s = w.chunk(2, 0), g.chunk(2, 1)
    with shared_amax(_table([(x, [x]), (w, w_s), (g, g_s)])):
        col = {"fprop": torch.cat([be.fprop(x, ws, prec, cfg) for ws in w_s], 1),
               "dgrad": sum(be.dgrad(gs.contiguous(), ws, prec, cfg) for gs, ws in zip(g_s, w_s)),
               "wgrad": torch.cat([be.wgrad(gs.contiguous(), x, prec, cfg) for gs in g_s], 0)}
    # row shards: columns of W and of X; G_Y whole
    w_r, x_r = [t.contiguous() for t in w.chunk(2, 1)], [t.contiguous() for t in x.chunk(2, 1)]
    with shared_amax(_table([(x, x_r), (w, w_r), (g, [g])])):
        row = {"fprop": sum(be.fprop(xs, ws, prec, cfg) for xs, ws in zip(x_r, w_r)),
               "dgrad": torch.cat([be.dgrad(g, ws, prec, cfg) for ws in w_r], 1),
               "wgrad": torch.cat([be.wgrad(g, xs, prec, cfg) for xs in x_r], 1)}
    args = {"fprop": (x, w, 128), "dgrad": (g, w, 192), "wgrad": (g, x, 64)}
    for gemm, (a, b, k) in args.items():
        bound = _bound(gemm, a, b, prec, cfg, k)
        for name, got in (("column", col[gemm]), ("row", row[gemm])):
            assert ((got - full[gemm]).abs() <= bound).all(), (name, gemm)


def test_without_the_context_nothing_is_reduced_and_empty_shards_have_amax_zero():
    t = torch.tensor([[1.0, -3.0]])
    assert not amax_shared() and whole_amax(t, "fp8_e4m3") is None
    with shared_amax(lambda a: a * 2):
        assert amax_shared()
        assert float(tensor_amax(t)) == 6.0
        assert float(whole_amax(t, "fp8_e4m3")) == 6.0
        assert whole_amax(t, "mxfp4") is None  # MX recipes have no tensor-level scale: nothing to share
        assert float(tensor_amax(torch.empty(0, 4))) == 0.0
    assert not amax_shared()


def test_a_shard_scaled_by_its_own_amax_is_caught_by_the_bound():
    """The check above can fail: the same shards without the context miss the bound."""
    be, cfg = get_backend("emulated"), QuantConfig(stochastic_rounding=False)
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 96, generator=gen), torch.randn(128, 96, generator=gen)
    w = torch.cat([w[:64], w[64:] * 8])  # the shards' amaxes differ widely
    got = torch.cat([be.fprop(x, ws.contiguous(), "fp8", cfg) for ws in w.chunk(2, 0)], 1)
    assert not ((got - be.fprop(x, w, "fp8", cfg)).abs() <= _bound("fprop", x, w, "fp8", cfg, 96)).all()
