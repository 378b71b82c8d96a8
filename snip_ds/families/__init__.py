"""The families survey: every causal-LM family of the installed transformers, built tiny and trained a step
with snip_ds through the Hugging Face Trainer, and the table of what trains (``snip-ds families``).

One concern per module:

* :mod:`~snip_ds.families.shrink`: a family's default config shrunk by general rules, its layer stack by
  :mod:`~snip_ds.families.depth` (every layer kind kept); :mod:`~snip_ds.families.fields` tells the config's
  fields apart (integers, token ids);
* :mod:`~snip_ds.families.overrides`: the few families that need more than the rules, each with its reason;
* :mod:`~snip_ds.families.build`: the tiny model, its random token batch and the plain step ("buildable");
* :mod:`~snip_ds.families.structure`: whether a model holds Mixture-of-Experts experts, decided by structure;
* :mod:`~snip_ds.families.probe`: one family through ``Trainer`` + :func:`snip_ds.hf.add_snip` per plan, with
  the claims checked (every planned layer ran quantized, losses finite, the adaptive plan solved);
* :mod:`~snip_ds.families.sweep`: every family in a child process of its own, with a timeout;
* :mod:`~snip_ds.families.report`: each family's status, and the Markdown table and JSON rows.

May import: anything in the product (it drives runs through engine/ and hf/); nothing in the product imports it.
"""
