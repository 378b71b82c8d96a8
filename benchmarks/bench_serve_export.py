"""A finished run served: its compressed-tensors export (``snip-ds export --format compressed-tensors``) loaded by
transformers on this CPU, its validation loss beside the run's own and the BF16 export's, its size beside the BF16
export's.

    python benchmarks/bench_serve_export.py --run runs/zero3 [--calibration-batches 8] [--tag NAME]

From the run's last checkpoint (``RUN/checkpoints``, its ``latest``) it writes, into a temporary directory, the
plain export in FP32 (the masters) and in BF16, and the compressed-tensors export with the unquantized parameters
in FP32 and in BF16. On the run's held-out batches (the run's ``eval_batches`` per rank at its micro-batch,
``global_batch_size / world_size`` of the checkpoint's data record, i.e. gradient accumulation 1, averaged over
its ranks as the run averages them) it computes the validation loss of:

* ``snip_ds planned``: snip_ds's own forward of the masters at the plan's precisions (the run's recipes and
  backend): the run's evaluation, recomputed;
* ``served fp32``: the compressed-tensors export, weights decompressed by compressed-tensors, in FP32;
* ``served bf16``: the same as transformers runs it by default in BF16;
* ``served fp32, --vllm-fused``: the export with each q/k/v and gate/up group at one scheme, in FP32;
* ``bf16 export``: the plain BF16 export (no quantization).

It also reports the run's own last logged ``eval/loss``, the largest logit difference between ``served fp32`` and
``snip_ds planned`` on the first batch beside the whole quantization effect (``snip_ds planned`` against the
unquantized FP32 masters), and the size of each export's ``model.safetensors``. Results go to
benchmarks/results/bench_serve_export[_TAG].{json,md}.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
RESULTS = Path(__file__).resolve().parent / "results"


def _batches(meta: dict) -> List[List[Dict[str, torch.Tensor]]]:
    """The run's evaluation batches, one list per rank."""
    from snip_ds.run.data import load_dataset_blocks
    from snip_ds.run.trainer import _eval_batches

    t = meta["settings"]["train"]
    world = int(meta.get("world_size") or 1)
    micro = max(1, int(meta["data"]["global_batch_size"]) // world)
    caps = int(t["max_corpus_bytes"])
    _, val, _, _ = load_dataset_blocks(t.get("dataset"), int(t["block_size"]), t.get("tokenizer_name_or_path"),
                                       seed=int(t["seed"]), max_bytes=caps,
                                       max_validation_bytes=max(caps // 16, int(t["block_size"]) * 64))
    return [_eval_batches(val, micro, int(t["eval_batches"]), rank, world) for rank in range(world)]


@torch.no_grad()
def _loss(model, per_rank) -> float:
    model.eval()
    means = [sum(model(input_ids=b["input_ids"], labels=b["labels"]).loss.double() for b in batches) / len(batches)
             for batches in per_rank]
    return float(sum(means) / len(means))


def _served(out: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=dtype, local_files_only=True)
    if dtype == torch.float32:  # compressed-tensors decompresses NVFP4 through BF16: cast those weights back
        model.hf_quantizer.compressor.decompress_model(model)
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
    return model.eval()


def _eval_loss(run: Path) -> Dict[str, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {str(e.step): e.value for e in acc.Scalars("eval/loss")}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a launch/train.py output directory (RUN/checkpoints)")
    parser.add_argument("--calibration-batches", type=int, default=8)
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from snip_ds.report.artifacts import checkpoint_meta
    from snip_ds.engine.checkpoint_layout import resolve
    from snip_ds.export import export_checkpoint
    from snip_ds.export.calib import planned_forward_model
    from snip_ds.export.serve import ServeOptions
    from snip_ds.quant_config import QuantConfig

    run = Path(args.run)
    tag_dir = resolve(run / "checkpoints")
    meta = checkpoint_meta(tag_dir)
    per_rank = _batches(meta)
    quant = QuantConfig(**meta["settings"]["quant"])
    serve = ServeOptions("compressed-tensors", calibration_batches=args.calibration_batches)
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        tmp = Path(tmp)
        fused = ServeOptions("compressed-tensors", calibration_batches=args.calibration_batches, vllm_fused=True)
        outs = {"hf_fp32": ("fp32", ServeOptions()), "hf_bf16": ("bf16", ServeOptions()),
                "ct_fp32": ("fp32", serve), "ct_bf16": ("bf16", serve), "ct_fused_fp32": ("fp32", fused)}
        records = {name: export_checkpoint(tag_dir, tmp / name, dtype=dtype, serve=options)
                   for name, (dtype, options) in outs.items()}
        sizes = {name: (tmp / name / "model.safetensors").stat().st_size for name in outs}
        masters = AutoModelForCausalLM.from_pretrained(str(tmp / "hf_fp32"), dtype=torch.float32).eval()
        planned = planned_forward_model(masters, meta["plan"]["assignment"], quant)
        served32 = _served(tmp / "ct_fp32", torch.float32)
        first = per_rank[0][0]["input_ids"]
        with torch.no_grad():
            ref = planned(input_ids=first).logits.float()
            logit_diff = float((served32(input_ids=first).logits.float() - ref).abs().max())
            effect = float((ref - masters(input_ids=first).logits.float()).abs().max())
        losses = {"snip_ds planned": _loss(planned, per_rank), "served fp32": _loss(served32, per_rank),
                  "served bf16": _loss(_served(tmp / "ct_bf16", torch.bfloat16), per_rank),
                  "served fp32, --vllm-fused": _loss(_served(tmp / "ct_fused_fp32", torch.float32), per_rank),
                  "bf16 export": _loss(AutoModelForCausalLM.from_pretrained(str(tmp / "hf_bf16"),
                                                                           dtype=torch.bfloat16), per_rank)}
    logged = _eval_loss(run)
    last = max(logged, key=int)
    result = {"run": str(run.resolve()), "step": meta["step"], "checkpoint": str(tag_dir),
              "run_eval_loss": {"step": int(last), "value": logged[last]}, "validation_loss": losses,
              "schemes": records["ct_fp32"]["schemes"], "calibration_batches": args.calibration_batches,
              "fallback": records["ct_fp32"]["fallback"],
              "vllm_fused": {"schemes": records["ct_fused_fp32"]["schemes"],
                             "raised": len(records["ct_fused_fp32"]["vllm_fused"]["raised"]),
                             "split_groups_without_it": len(records["ct_fp32"]["vllm_fused"]["split_groups"])},
              "max_logit_difference_served_fp32_vs_planned": logit_diff,
              "max_logit_difference_planned_vs_unquantized": effect,
              "model_safetensors_bytes": sizes, "torch": torch.__version__, "machine": platform.machine()}
    name = "bench_serve_export" + (f"_{args.tag}" if args.tag else "")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


def _markdown(r: dict) -> str:
    run_loss = r["run_eval_loss"]["value"]
    rows = [f"| the run's own eval/loss (step {r['run_eval_loss']['step']}, TensorBoard) | {run_loss:.6f} | |"]
    for label, value in r["validation_loss"].items():
        rows.append(f"| {label} | {value:.6f} | {1000 * (value - run_loss):+.3f} |")
    sizes = r["model_safetensors_bytes"]
    return "\n".join([
        f"# Serving export of {r['run']} (step {r['step']})", "",
        f"Schemes: {r['schemes']}; NVFP4 activation global scales from {r['calibration_batches']} calibration "
        f"batches; fallbacks: {len(r['fallback'])}. q/k/v or gate/up groups at different schemes: "
        f"{r['vllm_fused']['split_groups_without_it']}; --vllm-fused raises {r['vllm_fused']['raised']} layer(s) "
        f"(schemes {r['vllm_fused']['schemes']}).", "",
        "| validation loss | nats | vs the run's (millinats) |", "|---|---|---|", *rows, "",
        f"Largest logit difference, served FP32 vs snip_ds planned (first batch): "
        f"{r['max_logit_difference_served_fp32_vs_planned']:.4g}; the whole quantization effect (planned vs "
        f"unquantized FP32): {r['max_logit_difference_planned_vs_unquantized']:.4g}.", "",
        "| model.safetensors | bytes | vs BF16 export |", "|---|---|---|",
        *[f"| {k} | {v} | {v / sizes['hf_bf16']:.3f} |" for k, v in sizes.items()], ""])


if __name__ == "__main__":
    sys.exit(main())
