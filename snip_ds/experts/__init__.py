"""Mixture-of-Experts experts modules whose every expert runs its GEMMs at its own precision.

In transformers 5 the routed experts of an MoE block are not ``nn.Linear`` layers: one experts module holds each projection of all experts as one 3-D Parameter (Mixtral: ``gate_up_proj`` ``[E, 2I, H]``,
``down_proj`` ``[E, H, I]``), and the family's sparse MoE block calls it as
``experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])``.

:class:`~snip_ds.experts.module.SnipExperts` replaces such a module. It holds the very same Parameter objects (ZeRO-3 partitions them
in place, as for :class:`~snip_ds.linear.SnipLinear`) and slices one expert's 2-D weight inside ``forward``.
Each (expert, projection) pair is one planned layer, named ``<module path>.<expert>.<projection>``, with its own
precision (``bf16``, ``fp8``, ``fp4``, or one per GEMM) and its own stochastic-rounding generator. A pair at
``bf16`` runs the family's own operation on the slice; a quantized pair runs the autograd function of
:class:`~snip_ds.linear.SnipLinear` on the slice, so its fprop, dgrad and wgrad go through
:mod:`snip_ds.backend` exactly as a linear layer's do. Routing, activation, routing weights and biases are the
family's; so is the way the experts' outputs are summed per token, which follows the module's configured
experts implementation (``config._experts_implementation``, read at every forward): ``eager`` runs each
expert in turn and adds its weighted output into the result (``index_add_`` in the model's dtype); the others
(``grouped_mm``, ``batched_mm``, ...) gather the token-expert pairs sorted by expert, apply the element-wise
steps to all pairs at once and sum a token's ``K`` weighted outputs in one operation, as ``grouped_mm`` does.
With every pair at ``bf16`` the module's outputs and gradients are those of the family module under ``eager``
and under ``grouped_mm`` bit for bit (on the CPU, where this is tested); ``batched_mm`` multiplies token by
token, which may round differently from one GEMM per expert.

Each forward adds every expert's routed token count (token-expert pairs, so a token routed to ``K`` experts
counts once at each) to a running total that :meth:`~snip_ds.experts.module.SnipExperts.take_routed_tokens` returns and resets: an
expert's GEMMs cost ``6 * tokens * in_features * out_features`` FLOPs per step (:func:`~snip_ds.experts.points.routed_flops`); before any
token is counted, :meth:`~snip_ds.experts.points.ExpertLayerInfo.flops` expects the even share ``top_k / experts`` of a step's tokens.

For a statistics collection every pair also has an observation point, :class:`~snip_ds.experts.points.ExpertPoint` (:meth:`~snip_ds.experts.module.SnipExperts.points`):
an ``nn.Module`` that looks to :mod:`snip_ds.stats` like a bf16 :class:`~snip_ds.linear.SnipLinear` (``weight``
``[out, in]``, ``quant_config``, ``precision``, ``input_grad_only``, ``input_grad_observer``). While its
``input_grad_only`` is set, the pair's GEMM runs through the point, called with the pair's routed tokens only, so
that the collector's hooks see the pair's input ``X_e`` and the gradient of its own output ``y_e`` (which carries
the routing weight through the chain rule), and the point records which rows of ``hidden_states`` its tokens are.

Which modules hold experts and in what layout is :mod:`snip_ds.layouts.experts`' business (transformers' experts
interface or the Parameters' shapes, then a proof by equivalence); :func:`snip_ds.experts.model.swap_experts`
replaces every such module of a model and refuses, naming it, any whose layout is not proved.

The package: :mod:`~snip_ds.experts.points` (the planner's and the statistics' view of one pair),
:mod:`~snip_ds.experts.module` (:class:`~snip_ds.experts.module.SnipExperts`), :mod:`~snip_ds.experts.model`
(a model's experts as a whole: swap, layers, routed tokens, precisions).

May import: layouts/, linear, quant_config, types; never swap, stats/ or anything above.
"""
