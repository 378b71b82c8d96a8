"""The settings of a run, one home per setting: the ``"snip"`` section, DeepSpeed's JSON, the command line.

* :mod:`.settings`: ``SnipSettings``, the ``"snip"`` section parsed and validated (every key is defined once in
  :mod:`snip_ds.options`; the quantized linear's own dataclass is :mod:`snip_ds.quant_config`);
* :mod:`.deepspeed_config`: the DeepSpeed JSON resolved (``"auto"`` values, batch arithmetic, tensor parallelism);
* :mod:`.model_settings`: the settings checked against the model's layers; the plan a run starts from;
* :mod:`.train_args`: ``launch/train.py``'s flags and the settings they give.

May import: runtime/, the numerics core in snip_ds/, layouts/, experts/, stats/, planner/. Never report/, engine/ or
above. (``options`` and ``quant_config`` stay in snip_ds/: the backends and the statistics import them, and
``settings`` imports the planner's cost model, so one folder holding all four would import itself in a circle.)
"""
