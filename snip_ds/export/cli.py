"""The ``snip-ds export`` flags that pick the format (``--format``, ``--fallback``, ``--calibration-*``), kept
apart from :mod:`snip_ds.cli` so that its parser imports neither torch nor compressed-tensors."""
from __future__ import annotations

import argparse

FORMAT_CHOICES = ("hf", "compressed-tensors")  # snip_ds.export.ct.FORMATS, without importing torch
DEFAULT_CALIBRATION_BATCHES = 8  # snip_ds.export.serve's


def add_format_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the format flags to the ``export`` sub-parser. Values are checked by the export itself
    (:func:`snip_ds.export.serve.check_options`), so that a bad one is one ``error:`` line naming the flag."""
    parser.add_argument("--format", default="hf", metavar="{hf,compressed-tensors}",
                        help="hf: the plain model at --dtype (default); compressed-tensors: each planned layer "
                             "quantized at its forward precision (NVFP4 or FP8) in a checkpoint transformers and "
                             "vLLM load (pip install -e \".[serve]\")")
    parser.add_argument("--fallback", default=None, metavar="bf16",
                        help="compressed-tensors: export the layers the format cannot express unquantized (bf16), "
                             "each reason named in a warning; without it such a layer stops the export")
    parser.add_argument("--vllm-fused", action="store_true",
                        help="compressed-tensors: give each block's q/k/v and gate/up projections one scheme, the "
                             "most precise of theirs, as vLLM fuses each group into one module")
    parser.add_argument("--calibration-batches", type=int, default=DEFAULT_CALIBRATION_BATCHES, metavar="N",
                        help="compressed-tensors: batches of the run's training data that calibrate the NVFP4 "
                             f"activation global scales (default {DEFAULT_CALIBRATION_BATCHES})")
    parser.add_argument("--calibration-data", default=None, metavar="PATH",
                        help="compressed-tensors: calibrate on this data instead of the run's training data (which "
                             "a run of your own loop does not record): token ids (a .safetensors file holding an "
                             "integer 'input_ids' [blocks, tokens]), or a text/JSON-lines file or "
                             "launch/prepare_dataset.py directory read with the run's tokenizer and block size")

