"""What ``launch/train.py`` runs: snip_ds's own training loop on the DeepSpeed engine, and what it needs.

* :mod:`.trainer`: the loop: settings, model, data, engine, steps, evaluation, checkpoints, the end-of-run summary;
* :mod:`.model`: the embedded default Llama and user models; :mod:`.data`: the token streams;
  :mod:`.corpus`: the byte corpus and tokenizer files ``launch/prepare_dataset.py`` writes;
* :mod:`.resume`: resuming from a checkpoint; :mod:`.train_stop`: SIGTERM/SIGINT stop at a step boundary;
* :mod:`.ab`: ``launch/ab.py``, the same short training under several plans.

May import: engine/ and everything below it (report/, config/, planner/, stats/, the core, runtime/); never hf/,
export/, families/ or experiments/.
"""
