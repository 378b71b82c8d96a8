"""The statistics round to nearest through the fused CPU kernels: the same statistics, bit for bit.

The collection quantizes with :func:`snip_ds.backend.statistics_backend`, which rounds to nearest through the
fused CPU kernels where they are built; with the kernels reported unavailable it quantizes with
:mod:`snip_ds.quant` (the emulated reference). Both runs must give the same artifact, byte for byte.
"""
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from snip_ds.backend import cpu, get_backend, statistics_backend
from snip_ds.quant_config import QuantConfig
from snip_ds.stats import STUDY_FIELDS, CollectSettings, collect_statistics
from snip_ds.swap import swap_linears

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the fused CPU kernels are not built here")

RECIPES = {
    "nvfp4_2d+fp8_hybrid": QuantConfig(fp4_recipe="nvfp4", weight_2d=True, fp8_recipe="fp8_hybrid"),
    "nvfp4_1d+hadamard": QuantConfig(fp4_recipe="nvfp4", weight_2d=False, hadamard=True),
    "mxfp4+mxfp8": QuantConfig(fp4_recipe="mxfp4", fp8_recipe="mxfp8"),
    "nvfp4_rne": QuantConfig(fp4_recipe="nvfp4", stochastic_rounding=False),
}


def _model(qc):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    m = LlamaForCausalLM(cfg)
    swap_linears(m, "fp8", qc, seed=3)
    return m


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 257, (2, 32), generator=g) for _ in range(2)]


def _counting(monkeypatch):
    calls = []
    fused = cpu.fake_quantize

    def counted(*args, **kw):
        calls.append(args[1])
        return fused(*args, **kw)
    monkeypatch.setattr(cpu, "fake_quantize", counted)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("rounding", ["recipe", "nearest"])
@pytest.mark.parametrize("recipes", list(RECIPES))
def test_collection_is_bit_identical_with_the_fused_kernels_and_without(recipes, rounding, monkeypatch):
    model = _model(RECIPES[recipes])
    settings = CollectSettings(study_fields=tuple(STUDY_FIELDS), bwd_propagated=True, bwd_rounding=rounding,
                               estimator="mc_fisher", forward_drift=True)
    calls = _counting(monkeypatch)
    fused = collect_statistics(model, _batches(), settings, lr=1e-3)
    assert len(calls) > 0 and {"fp8_e4m3", "nvfp4", "mxfp4", "mxfp8"} & set(calls)
    monkeypatch.setattr(cpu, "available", lambda: False)  # as where the kernels fail to build
    n_fused = len(calls)
    reference = collect_statistics(model, _batches(), settings, lr=1e-3)
    assert len(calls) == n_fused  # the second run never reached the kernels
    assert json.dumps(fused, sort_keys=True) == json.dumps(reference, sort_keys=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qc", list(RECIPES.values()), ids=list(RECIPES))
def test_statistics_quantize_is_the_reference_bit_for_bit(qc, dtype, monkeypatch):
    """Every operand role, axis and precision, with and without a slice's tensor amax, on a shape that is
    not a multiple of the block sizes."""
    calls = _counting(monkeypatch)
    fast, ref = statistics_backend(), get_backend("emulated")
    assert fast is not ref and not ref.fused_rne
    torch.manual_seed(5)
    x = (torch.randn(67, 90) * torch.exp(torch.randn(67, 90) * 2)).to(dtype)
    x[3, :40] = 0.0  # blocks of zeros
    for precision in ("fp8", "fp4"):
        for role in ("x", "w", "g"):
            for axis in (0, -1):
                for amax in (None, x.float().abs().amax() * 4):
                    cfg = QuantConfig(**{**qc.__dict__, "stochastic_rounding": False})
                    a = fast.quantize(x, precision, role, axis, cfg, None, amax)
                    b = ref.quantize(x, precision, role, axis, cfg, None, amax)
                    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
                    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (precision, role, axis)
        whole = fast.quantize_whole(x, precision, "w", 0, cfg)
        assert torch.equal(whole.view(torch.int32), ref.quantize_whole(x, precision, "w", 0, cfg).view(torch.int32))
    assert len(calls) >= 24
