"""Process plumbing, below everything else: nothing here imports another part of snip_ds (only runtime/).

* :mod:`.console`: rank 0's console lines (``say``), printed above a progress bar;
* :mod:`.fileio`: atomic writes; :mod:`.distributed`: rank, world size, process-group set-up and barriers;
* :mod:`.jit_builds`: where DeepSpeed's and snip_ds's JIT ops build; :mod:`.cpuinfo_cache`: DeepSpeed's CPU probe, once;
* :mod:`.compile_stance`: ``torch.compile``'s stance; :mod:`.omp`: torch's threads across CBC solves;
* :mod:`.deprecations`: third-party messages a user cannot act on, dropped;
* :mod:`.global_rng`: Python's, NumPy's and torch's global generators saved and restored;
* :mod:`.faults`: fault injection for the reliability tests (``SNIP_DS_PAUSE_AT``);
* :mod:`.old_paths`: the module paths of the previous release, still importable with a DeprecationWarning.

May import: the standard library, torch, and runtime/ itself.
"""
