"""Research code: the plan-quality comparison and the validation of the statistics (docs/experiments.md).

Nothing in the training package imports this package; it may import anything from it. The launch scripts
``launch/compare_plans.py`` and ``launch/validate_metrics.py`` parse their flags and call into it.

Plan comparison (``launch/compare_plans.py``):

* :mod:`~snip_ds.experiments.grid` — methods, presets, phases, the study model and its data;
* :mod:`~snip_ds.experiments.training` — the plain-torch training loop, evaluation and checkpoints;
* :mod:`~snip_ds.experiments.plans` — solving every method's plans at a checkpoint, putting one on a model,
  what the statistics predict for it;
* :mod:`~snip_ds.experiments.runs` — running the grid cell by cell, and re-rendering finished grids;
* :mod:`~snip_ds.experiments.results` — the result file: written, merged, read as a ``--versus`` grid;
* :mod:`~snip_ds.experiments.paired` — means and standard errors of paired differences, rank correlation;
* :mod:`~snip_ds.experiments.summary` — what the records say: gaps, targets, λ sweep and calibration;
* :mod:`~snip_ds.experiments.report` and :mod:`~snip_ds.experiments.figures` — the markdown and the plots.

The plan study (``launch/plan_study.py``), on the same grid, training and plan machinery:

* :mod:`~snip_ds.experiments.plan_study` — per model seed its warm-up, statistics and plans at one FP4 share,
  random plans per cell, cells in worker processes, ``cells.json`` and resume;
* :mod:`~snip_ds.experiments.study_stats` — pairing at an equal share, clustered standard errors, verdicts;
* :mod:`~snip_ds.experiments.study_report` — ``summary.{json,md}`` and the per-model-seed plot.

Metric validation (``launch/validate_metrics.py``):

* :mod:`~snip_ds.experiments.truths` — the measured FLD, BWD and FWD truths per layer, and what a run measured;
* :mod:`~snip_ds.experiments.scores` — rank correlations, reproducibility, calibration, the per-layer table;
* :mod:`~snip_ds.experiments.validation` — one run: warm-up, fixed batches, measurement, then scoring.

May import: anything in the product; nothing in the product imports it (tests/test_experiments_isolation.py).
"""
