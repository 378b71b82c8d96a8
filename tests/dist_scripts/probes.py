"""What several distributed test scripts measure the same way: GEMM calls per precision, parameter sums."""
import torch


def count_gemms(counts: dict) -> None:
    """Wraps every registered backend's three GEMMs so that each call is counted per precision
    (``counts["fprop:fp8"]`` ...)."""
    from snip_ds.backend.base import _REGISTRY, GemmBackend

    for be in _REGISTRY.values():
        if not isinstance(be, GemmBackend):
            continue
        for gemm in ("fprop", "dgrad", "wgrad"):
            orig = getattr(be, gemm)

            def counted(*a, _orig=orig, _gemm=gemm, **k):
                counts[f"{_gemm}:{a[2]}"] = counts.get(f"{_gemm}:{a[2]}", 0) + 1
                return _orig(*a, **k)
            setattr(be, gemm, counted)


def param_sum(module: torch.nn.Module) -> float:
    """Σ of this rank's parameters in float64 (ZeRO-3's partitions gathered; tensor-parallel shards as held):
    equal in two runs only if they hold the same weights."""
    import deepspeed

    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params), torch.no_grad():
        return float(sum(p.double().sum() for p in params))
