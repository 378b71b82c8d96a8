"""What a run tells and leaves: console lines, the progress bar, TensorBoard, the plan and statistics files.

* :mod:`.artifacts`: ``plan.json`` / ``stats.json`` a run writes, and reading a plan or statistics back from any
  run directory, checkpoint or file;
* :mod:`.run_report`: one console line per re-plan, a plan in one line; :mod:`.run_summary`: the end-of-run
  summary and ``summary.json``; :mod:`.progress`: the progress bar or plain progress lines;
* :mod:`.tensorboard`: the TensorBoard logger and the precision-map image;
* :mod:`.stats_table`: ``snip-ds show STATS.json``.

May import: runtime/ and the numerics core directly in snip_ds/ (types, plan, stats_file, ...); never config/,
engine/ or anything above (the engine and both loops import this folder).
"""
