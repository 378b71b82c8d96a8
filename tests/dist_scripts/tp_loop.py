"""Tensor parallelism in a user's own loop: ``snip_ds.initialize`` with ``"tensor_parallel": {"autotp_size": N}``.

Run by tests/test_tensor_parallel.py under the deepspeed launcher (or as one plain process for N = 1). Every
data-parallel rank reads its own batches (the ranks of one tensor-parallel group the same ones), so a run at
TP = 2 on 2 ranks and a run at TP = 1 on 1 rank see the same data. Writes ``<out>.<rank>`` (JSON): the losses of
``--steps`` steps, the class and precision of every planned layer, how many quantized GEMMs each layer ran
(counted through the backends), and with ``--collect`` one statistics collection's artifact before training.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import snip_ds  # noqa: E402
from snip_ds.runtime import distributed as sdist  # noqa: E402
from snip_ds.engine import init_distributed  # noqa: E402
from snip_ds.engine.checkpoint_layout import CheckpointError  # noqa: E402
from snip_ds.config.settings import ConfigError  # noqa: E402

from probes import count_gemms, param_sum  # noqa: E402  (tests/dist_scripts, the script's folder)

HIDDEN, VOCAB, SEQ = 128, 96, 16


def _model(hidden: int = HIDDEN):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=SEQ, tie_word_embeddings=False))


def _gather(t, group, dim):
    import torch.distributed as dist
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def _abs_product(gemm, a, b, prec, cfg):
    """``|Q(a)| |Q(b)|`` as ``gemm`` multiplies them (the reference quantization, dequantized): what bounds the
    round-off of any order of that GEMM's FP32 sums."""
    from snip_ds.backend.emulated import reference_operands
    qa, qb = (p.values * p.tensor_scale for p in reference_operands(gemm, a, b, prec, cfg))
    if gemm == "fprop":
        return qa.abs() @ qb.abs().t()
    if gemm == "dgrad":
        return qa.abs() @ qb.abs()
    return qa.abs().t() @ qb.abs()


def check_layers(engine) -> dict:
    """Every tensor-parallel layer at fp8 and fp4 against one whole SnipLinear of the gathered weight, on the same
    random X and G_Y: output, input gradient and weight gradient (gathered) must differ from the whole layer's by
    at most the round-off of summing the same exact products in another order, ``γ_{K+2} |Q(A)||Q(B)|`` (K the
    contraction length, γ_m = m·u / (1 - m·u), u = 2⁻²⁴; the 2 covers the scaling by the tensor scales).
    Returns per layer and precision the largest ratio of a difference to its bound, and how many elements
    differ at all."""
    from snip_ds.linear import SnipLinear

    u = 2.0 ** -24
    gen = torch.Generator().manual_seed(7)
    out = {}
    for fqn, m in engine.layers.items():
        col = m.tp_shard == "column"
        group, r = m.mp_group, m.tp_index
        w = _gather(m.weight.detach(), group, 0 if col else 1)
        n, k = w.shape
        ns, ks = m.weight.shape
        x = torch.randn(2, SEQ, k, generator=gen)
        g = torch.randn(2, SEQ, n, generator=gen)
        for prec in ("fp8", "fp4"):
            saved = m.precision
            m.precision = prec
            x_loc = (x if col else x[..., r * ks:(r + 1) * ks]).clone().requires_grad_(True)
            y = m(x_loc)
            gx, gw = torch.autograd.grad(y, [x_loc, m.weight], g[..., r * ns:(r + 1) * ns] if col else g)
            m.precision = saved
            y = _gather(y.detach(), group, -1) if col else y.detach()
            gx = gx if col else _gather(gx, group, -1)
            gw = _gather(gw, group, 0 if col else 1)
            ref = SnipLinear(k, n, bias=False, precision=prec, quant_config=m.quant_config)
            with torch.no_grad():
                ref.weight.copy_(w)
            xr = x.clone().requires_grad_(True)
            yr = ref(xr)
            gxr, gwr = torch.autograd.grad(yr, [xr, ref.weight], g)
            x2, g2 = x.reshape(-1, k), g.reshape(-1, n)
            worst, differ = 0.0, 0
            for got, want, gemm, a, b, length in ((y, yr, "fprop", x2, w, k), (gx, gxr, "dgrad", g2, w, n),
                                                  (gw, gwr, "wgrad", g2, x2, x2.shape[0])):
                gamma = (length + 2) * u / (1 - (length + 2) * u)
                bound = gamma * _abs_product(gemm, a, b, prec, m.quant_config).reshape(want.shape)
                diff = (got - want.detach()).abs()
                differ += int((diff > 0).sum())
                worst = max(worst, float((diff / bound.clamp_min(1e-30)).max()))
            out[f"{fqn}:{prec}"] = {"worst": worst, "differ": differ}
    return out


def _bf16_loss(engine, ids) -> float:
    """The model's loss on ``ids`` with every layer unquantized (what an exported model computes)."""
    saved = {f: m.precision for f, m in engine.layers.items()}
    for m in engine.layers.values():
        m.precision = "bf16"
    engine.ds.eval()
    with torch.no_grad():
        loss = float(engine.ds(input_ids=ids, labels=ids).loss)
    engine.ds.train()
    for f, m in engine.layers.items():
        m.precision = saved[f]
    return loss


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--plan", default="bf16")
    p.add_argument("--zero", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--fp8_recipe", default="fp8_hybrid")
    p.add_argument("--fp4_recipe", default="nvfp4")
    p.add_argument("--collect", action="store_true")
    p.add_argument("--check_layers", action="store_true", help="check_layers() instead of training")
    p.add_argument("--snip", default="{}", help="more snip settings (JSON)")
    p.add_argument("--save", help="save a checkpoint here after --save_at steps (default: all), then go on")
    p.add_argument("--save_at", type=int, help="the step after which --save saves (default: --steps)")
    p.add_argument("--resume", help="resume from this checkpoint, then take the steps")
    p.add_argument("--skip", type=int, default=0, help="batches the resumed run skips (those taken before)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    init_distributed()
    rank, world = sdist.rank(), sdist.world_size()
    more = json.loads(args.snip)
    snip = {"plan": args.plan, "train": {"seed": 0}, **more,
            "quant": {"fp8_recipe": args.fp8_recipe, "fp4_recipe": args.fp4_recipe, **more.get("quant", {})}}
    config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8}},
              "zero_optimization": {"stage": args.zero}, "steps_per_print": 10 ** 9, "snip": snip}
    if args.tp > 1:
        config["tensor_parallel"] = {"autotp_size": args.tp}
    out = {"rank": rank}
    counts: dict = {}
    try:
        engine = snip_ds.initialize(_model(args.hidden), config, tokens_per_step=args.micro * SEQ,
                                    resume_from=args.resume)
    except (ConfigError, CheckpointError) as err:
        out["error"] = str(err)
        Path(f"{args.out}.{rank}").write_text(json.dumps(out))
        return 0
    if args.check_layers:
        out["layers"] = check_layers(engine)
        Path(f"{args.out}.{rank}").write_text(json.dumps(out))
        torch.distributed.barrier()
        return 0
    # One global batch per step, each data-parallel rank its slice (a tensor-parallel group's ranks the same one):
    # every shape of the same global batch size sees the same data.
    dp_rank, dp = rank // args.tp, world // args.tp
    gen = torch.Generator().manual_seed(100)
    batches = [torch.randint(0, VOCAB, (args.micro * dp, SEQ), generator=gen)[dp_rank * args.micro:][:args.micro]
               for _ in range(args.skip + args.steps + 1)]
    batches = batches[args.skip:]
    if args.collect:
        from snip_ds.stats import CollectSettings, collect_statistics
        stats = collect_statistics(engine.ds.module, [{"input_ids": batches[-1], "labels": batches[-1]}],
                                   # the default prior (factored): each shard completes its sums over the group
                                   CollectSettings(retain_graph=args.zero < 3),
                                   lr=1e-2, reduce=sdist.dist_sum, world_size=engine.state.dp_size,
                                   layers=list(engine.layers))
        out["stats"] = {f: {k: rec[k] for k in ("fld", "bwd")} for f, rec in stats["layers"].items()}
    count_gemms(counts)
    losses = []
    save_at = args.steps if args.save_at is None else args.save_at
    for step, ids in enumerate(batches[:args.steps] + [None]):
        if args.save and step == save_at:
            engine.save_checkpoint(args.save, {})
            out["bf16_loss"] = _bf16_loss(engine, batches[step])  # the next batch, as an exported model sees it
        if ids is not None:
            losses.append(engine.train_step([{"input_ids": ids, "labels": ids}]))
    history = engine.planner.history if engine.planner is not None else []
    out.update(losses=losses, dp_size=engine.state.dp_size, gemms=counts, plan=engine.plan.digest(),
               history=[h["step"] for h in history], step=engine.step, param_sum=param_sum(engine.ds.module),
               layers={f: [type(m).__name__, m.precision, list(m.weight.shape)] for f, m in engine.layers.items()})
    Path(f"{args.out}.{rank}").write_text(json.dumps(out))
    if world > 1:
        torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
