"""How a causal LM's quantizable GEMMs are found: the one place that knows model layouts.

Nothing here is keyed by a model family's class or attribute names. A model is read by its structure and each
replacement is proved by behaviour before it is trusted:

* :mod:`~snip_ds.layouts.blocks`: the decoder blocks, the numbered entries of the model's block list
  (``model.layers.<i>``, ``transformer.h.<i>``, ...), at the level the model declares as its repeated block;
* :mod:`~snip_ds.layouts.linears`: which modules are linear GEMMs (``y = x·Wᵀ + b``, or ``y = x·W + b`` for a
  weight stored transposed, as GPT-2's ``Conv1D``), proved once per class on a random probe;
* :mod:`~snip_ds.layouts.routers`: which linears of an MoE block are its routers, proved by what consumes their
  output (ranked, and the ranks select the experts' inputs);
* :mod:`~snip_ds.layouts.experts`: Mixture-of-Experts experts modules, their layout read from transformers'
  experts interface or their Parameters' shapes, accepted only after snip_ds's replacement reproduces the
  module's own forward and backward on a random routing.

May import: snip_ds.types only.
"""
