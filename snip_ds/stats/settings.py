"""How one statistics collection estimates: :class:`CollectSettings`, the settings the collector
(:mod:`snip_ds.stats.collector`) and every estimator it composes (:mod:`~snip_ds.stats.fld`,
:mod:`~snip_ds.stats.bwd`, :mod:`~snip_ds.stats.fields`, :mod:`~snip_ds.stats.experts`) read. It sits below
them all, so that the estimators name it without importing the collector that composes them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from snip_ds import divergence as dv
from snip_ds.options import check_fields, reads
from snip_ds.types import QUANTIZED


@dataclass(frozen=True)
class CollectSettings:
    """How one collection estimates the statistics (the training state it reads is
    :func:`collect_statistics`'s arguments). Bad values raise a ValueError naming the field.

    Attributes:
        estimator: ``"mc_fisher"`` (default; MC Fisher probes), ``"empirical"`` (the training G_Y, no extra
            pass) or ``"isotropic"`` (ablation: ``N(0, I)`` probes at the last block's output times α).
        num_probes: probes per batch (mc_fisher, isotropic).
        fld_form: which FLD the planner gets as ``fld``: ``"sequence"`` (default; ``(1/2N)Σ_rows (Σ_t
            g_t·E_t)²``, the Gauss-Newton form with every token and channel pair of a sequence) or
            ``"channel"`` (ablation; ``(1/2N)Σ_j (Σ_t E_tj²)·mean_t g_tj²``, diagonal and factorised over
            tokens). Both are recorded (``fld_sequence``, ``fld_channel``).
        bwd_rounding: how the backward statistics round G_Y. ``"recipe"`` (default): as training does; where
            the recipe rounds G_Y stochastically (NVFP4/MXFP4 by default) the drift is its exact expectation
            over that rounding, the systematic part plus the rounding noise. ``"nearest"`` (ablation, the
            behaviour before): round to nearest, deterministic, whatever the recipe. Either way the
            systematic part alone is recorded too (``bwd_bias``, ``bwd_drift_bias``).
        bwd_propagated: also estimate what each layer's dgrad error does to the upstream weights (the ratio
            estimate of docs/method.md): ``bwd_dgrad`` (loss units; what per-GEMM plans with
            ``dgrad_cost: upstream`` price dgrad by), ``bwd_drift_propagated`` (the same drift in parameter
            units), ``bwd_propagated`` (the ablation: direct BWD + that drift priced like the gradient
            direction) and ``dgrad_err``.
        forward_drift: also measure ``fwd``, what each layer's fprop error does to the *update*: the drift
            ``η·c·ΔG ⊙ P`` of the planned weights, ΔG the change of their training gradient when layer ℓ's
            output carries E_ℓ(p), priced in loss units as BWD prices its drift (with the same probes, in the
            full Fisher form ``(1/2N)·mean_r ⟨G^probe_r, drift⟩²``). Two more forward and backward passes per
            probe (:meth:`~snip_ds.stats.fwd.ForwardDrift.passes`) and one weight-sized FP32
            tensor per layer while a batch runs. Needs ``estimator="mc_fisher"`` and weight-shaped
            preconditioners (a mapping of tensors, or None for the fallback), not the partitioned states'
            callable.
        study_fields: groups of :data:`~snip_ds.stats_file.STUDY_FIELDS` to record besides what a plan
            is solved from (default none): ``"fld_forms"`` (``fld_sequence`` and ``fld_channel``; ``fld`` is
            always the ``fld_form`` one), ``"first_order"``, ``"quant_err"`` (``quant_err``,
            ``rel_quant_err`` and their per-operand parts: what the quant_err baselines are solved from),
            ``"bwd_bias"`` (``bwd_bias``, ``bwd_drift_bias``: ``bwd_estimate="systematic"``) and
            ``"bwd_drift"``. Without ``fld_forms``, ``first_order`` and ``quant_err`` the training
            gradient's hook computes no fprop error at all (the probe's hook prices the sequence form); the
            fields recorded either way are the same numbers.
        precisions: quantized precisions to measure (``fp8``, ``fp4``).
        precond_fallback: the preconditioner where :func:`collect_statistics` gets none (no optimizer state
            yet): ``"factored"`` (the rank-1 row × column estimate of ``G_W²``, on Adam's first-step scale
            and not moved by the round-off of the elements whose gradient cancels:
            :func:`snip_ds.divergence.factored_second_moment`), ``"grad_sq"`` (Adam's first-step
            ``v̂ = G_W²`` element by element; ill-conditioned) or ``"ones"``.
        seed: seed of the private generators (probe labels, isotropic noise, Hadamard signs).
        lam: λ to record in the artifact (the BWD weight the planner uses by default).
        retain_graph: back-propagate every probe through the first forward's retained graph (cheapest).
            False runs one fresh forward per probe instead, so each backward is an ordinary single one:
            needed under ZeRO-3, which releases the gathered weights after each backward.
        collect_tf32: on CUDA, run the collection's FP32 matrix products on TF32 tensor cores
            (:func:`~snip_ds.stats.common.fp32_matmuls`); False: IEEE FP32. No effect elsewhere.
    """

    estimator: str = reads("estimator")
    num_probes: int = reads("num_probes")
    fld_form: str = reads("fld_form")
    bwd_rounding: str = reads("bwd_rounding")
    bwd_propagated: bool = False
    forward_drift: bool = False
    study_fields: Tuple[str, ...] = reads("study_fields")
    precisions: Tuple[str, ...] = QUANTIZED
    precond_fallback: str = "factored"
    seed: int = 0
    lam: Optional[float] = reads("bwd_lambda", default=None)
    retain_graph: bool = True
    collect_tf32: bool = reads("collect_tf32")

    def __post_init__(self) -> None:
        object.__setattr__(self, "precisions", tuple(self.precisions))
        check_fields(self)  # the fields that read a setting, checked as the "snip" section checks it
        bad = [p for p in self.precisions if p not in QUANTIZED]
        if bad or not self.precisions:
            raise ValueError(f"precisions: {list(self.precisions)!r}; choose from {', '.join(QUANTIZED)}")
        if self.precond_fallback not in dv.FALLBACKS:
            raise ValueError(f"precond_fallback: unknown {self.precond_fallback!r}; "
                             f"valid: {', '.join(dv.FALLBACKS)}")
        if self.forward_drift and self.estimator != "mc_fisher":
            raise ValueError(f"forward_drift needs estimator='mc_fisher' (its probes price the drift), "
                             f"got {self.estimator!r}")
