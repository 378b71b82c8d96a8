"""The training loop behind ``launch/train.py``: data, model, plan, DeepSpeed engine, logging, checkpoints.

Everything a user can get wrong (config, plan, dataset, model, checkpoint) is checked before the first
step and reported as one ``error: ...`` line naming the file or field (exit code 2). The command line is
:mod:`snip_ds.config.train_args`', stopping on a signal :mod:`snip_ds.run.train_stop`'s.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from snip_ds.run import resume
from snip_ds.runtime import console, faults
from snip_ds.runtime.deprecations import quiet_third_party
from snip_ds.report.progress import Progress, console_interval, over_steps
from snip_ds.config.deepspeed_config import resolve_ds_config, tensor_parallel_degree, validate_with_deepspeed
from snip_ds.config.settings import ConfigError, SnipSettings
from snip_ds.report.tensorboard import config_text, make_logger
from snip_ds.config.train_args import RunFault, UserError, build_parser, settings_from_args
from snip_ds.run.train_stop import StopFlag

# torch, transformers and DeepSpeed are imported inside train() and main(), so that `--help` answers at once.

def _plan_words(settings: SnipSettings, engine) -> str:
    if settings.is_adaptive:
        from snip_ds.engine.schedule import describe_replans
        replans = describe_replans(settings.train.max_steps, settings.replan_every, settings.early_replan_steps,
                                   start=engine.step)
        return f"adaptive (rho {settings.efficiency_saving}, method {settings.method}, {replans})"
    return f"{settings.plan!r} (fp4 share {engine.plan_fp4_share():.2f})"


def _write_artifacts(out_dir: Path, plan, stats: Optional[Dict[str, Any]]) -> None:
    """Collective: rank 0 writes ``plan.json`` and (adaptive, once collected) ``stats.json`` under ``out_dir``,
    each atomically (a failed write leaves the previous file whole); a failure stops every rank with
    :class:`RunFault` naming the file and the cause."""
    from snip_ds.runtime import distributed as sdist
    from snip_ds.report.artifacts import PLAN_FILE, STATS_FILE, write_plan, write_stats

    problem = None
    if sdist.rank() == 0:
        name = STATS_FILE
        try:
            if stats is not None:
                write_stats(out_dir, stats)
            name = PLAN_FILE
            write_plan(out_dir, plan)
        except OSError as err:
            problem = (f"{out_dir / name}: cannot be written ({err.strerror or err} [errno {err.errno}]); "
                       f"the previous {name}, if any, is left whole")
    problem = sdist.first_error(problem)
    if problem:
        raise RunFault(problem)


def _eval_batches(val_ds, micro_bs: int, n_batches: int, rank: int, world: int) -> List[dict]:
    from snip_ds.run.data import DataStream

    stream = DataStream(val_ds, micro_bs, seed=0, rank=rank, world_size=world, shuffle=False)
    return [stream.next_batch() for _ in range(min(n_batches, stream.steps_per_epoch))]


def _compile_backend(t, args: argparse.Namespace, ds_cfg: Dict[str, Any], tp: int) -> str:
    """The ``torch.compile`` backend a compiling run uses (``inductor`` unless named); an unknown name, ZeRO-3
    or tensor parallelism is a :class:`UserError` naming the flag or the JSON field that gave it."""
    import torch._dynamo

    flag = "--torch_compile" if args.torch_compile or args.torch_compile_backend or args.torch_compile_mode else \
        f"{args.deepspeed}: snip.train.torch_compile"
    if int((ds_cfg.get("zero_optimization") or {}).get("stage", 0)) == 3:
        raise UserError(f"{flag}: not with ZeRO stage 3, whose parameter hooks break the graph at every module: "
                        f"each layer would compile on its own and, past torch's recompile limit, run eagerly; "
                        f"compile under ZeRO stage 0, 1 or 2 (ds_configs/zero1.json)")
    if tp > 1:
        raise UserError(f"{flag}: not with tensor parallelism (not tested: the shards reduce their amaxes across "
                        f"ranks inside the forward)")
    name = t.torch_compile_backend or "inductor"
    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        where = "--torch_compile_backend" if args.torch_compile_backend else \
            f"{args.deepspeed}: snip.train.torch_compile_backend"
        raise UserError(f"{where}: unknown torch.compile backend {name!r}; known: {', '.join(sorted(known))}")
    return name


def train(args: argparse.Namespace) -> int:
    """Runs the whole job; returns the process exit code."""
    import torch

    from snip_ds.runtime import distributed as sdist
    from snip_ds.run.data import DataStream, load_dataset_blocks
    from snip_ds.engine import CheckpointError, NonFiniteError, init_distributed, initialize  # imports DeepSpeed
    from snip_ds.config.model_settings import initial_plan
    from snip_ds.engine.tensor_parallel import data_parallel
    from snip_ds.engine.checkpoint import CheckpointSaveError
    from snip_ds.engine.checkpoint_layout import META_FILE, is_universal, model_architecture, model_fingerprint
    from snip_ds.engine.checkpoint_verify import check_resumable
    from snip_ds.engine.universal import check_universal_batch, with_load_universal
    from snip_ds.runtime.global_rng import seed_global_rngs
    from snip_ds.run.model import build_model
    from snip_ds.engine.state import MEASURE_SEED_OFFSET, STATS_SEED_OFFSET
    from snip_ds.swap import LayerInfo, layer_infos
    from snip_ds.backend.kernels.switches import direct_switched_on

    # Subnormal FP32 intermediates (squares of tiny gradient errors in the statistics) are ~100x slower on
    # CPUs and lie far below every FP8/FP4 grid step: flush them to zero for the whole (training) process.
    torch.set_flush_denormal(True)
    raw_cfg, settings = settings_from_args(args)
    t = settings.train
    if args.dist_timeout is not None and not 0 < args.dist_timeout < math.inf:
        raise UserError(f"--dist_timeout: must be a positive number of seconds, got {args.dist_timeout}")
    try:
        faults.spec()  # a malformed SNIP_DS_PAUSE_AT is an error before anything starts
        direct_switched_on()  # as is a malformed SNIP_DS_TRITON_DIRECT (read where the Triton kernels load)
    except ValueError as err:
        raise UserError(str(err)) from None
    init_distributed(args.dist_timeout)
    rank, world = sdist.rank(), sdist.world_size()
    on_gpu = torch.cuda.is_available()
    ds_cfg = resolve_ds_config(raw_cfg, max_steps=t.max_steps, on_gpu=on_gpu, source=args.deepspeed,
                               micro_batch_size=args.per_device_train_batch_size,
                               gradient_accumulation_steps=args.gradient_accumulation_steps,
                               learning_rate=args.learning_rate, world_size=world)
    validate_with_deepspeed(ds_cfg, args.deepspeed)
    micro_bs, ga = ds_cfg["train_micro_batch_size_per_gpu"], ds_cfg["gradient_accumulation_steps"]
    # Tensor parallelism: the ranks of one group hold shards of the same layers and read the same batches; the
    # data (and every batch-size or throughput figure) follows the data-parallel rank and size.
    tp = tensor_parallel_degree(ds_cfg, args.deepspeed, world)
    rank_d, world_d = data_parallel(rank, world, tp)
    compile_backend = _compile_backend(t, args, ds_cfg, tp) if t.compiles else None  # errors before anything
    dtype = torch.bfloat16 if ds_cfg.get("bf16", {}).get("enabled") else torch.float32

    # ---------------- data and model: every user error surfaces here, before training ----------------
    try:
        train_ds, val_ds, vocab, data_info = load_dataset_blocks(
            t.dataset, t.block_size, t.tokenizer_name_or_path, seed=t.seed,
            max_bytes=t.max_corpus_bytes, max_validation_bytes=max(t.max_corpus_bytes // 16, t.block_size * 64))
        try:  # DataStream's messages do not name the dataset
            stream = DataStream(train_ds, micro_bs, seed=t.seed, rank=rank_d, world_size=world_d)
        except ValueError as err:
            raise ValueError(f"dataset {t.dataset or 'stdlib'}: training split: {err}") from None
        try:
            eval_batches = _eval_batches(val_ds, micro_bs, t.eval_batches, rank_d, world_d)
        except ValueError as err:
            raise ValueError(f"dataset {t.dataset or 'stdlib'}: validation split: {err}") from None
        if not eval_batches:
            raise ValueError(f"dataset {t.dataset or 'stdlib'}: validation split has fewer blocks than one "
                             f"evaluation batch ({micro_bs} per rank x {world_d} data-parallel ranks)")
        model = build_model(t.model_name_or_path, t.model_config, vocab_size=vocab, seed=t.seed, dtype=dtype,
                            block_size=t.block_size)
    except (ValueError, FileNotFoundError, OSError) as err:
        raise UserError(str(err)) from None
    # Python's, NumPy's and torch's global generators, as the Trainer's set_seed: dropout and any other random
    # operation of the model draw from them (torch seeds its own randomly at start-up); a resume restores the
    # saved states after this.
    seed_global_rngs(t.seed)

    tokenizer = str(data_info.get("tokenizer", "unknown"))  # recorded in checkpoints for `snip-ds export`
    if tokenizer not in ("byte", "unknown") and Path(tokenizer).exists():
        tokenizer = str(Path(tokenizer).resolve())

    # ---------------- plan and checkpoint: checked against the model before DeepSpeed starts ----------------
    tokens_per_step = micro_bs * ga * t.block_size
    try:
        infos = layer_infos(model, settings.exclude)
        plan = initial_plan(list(infos), {fqn: i.flops(tokens_per_step) for fqn, i in infos.items()}, settings)
    except ValueError as err:
        raise UserError(str(err)) from None
    from snip_ds.backend import check_backend, resolve
    gemm_device = torch.device("cuda" if on_gpu else "cpu")
    try:  # a backend that cannot run here is an error now, not a failure in the first step
        check_backend(settings.quant, gemm_device)
    except ValueError as err:
        raise UserError(f"{args.deepspeed}: snip.quant.backend: {err}") from None
    backends = {p: resolve(settings.quant.backend, p, settings.quant, gemm_device).name for p in ("fp8", "fp4")}
    backend_words = ", ".join(f"{p} on {name}" for p, name in backends.items())
    schedule_line = None
    if args.resume_from_checkpoint:
        # Every rank checks the checkpoint (its share of the checksums), then the ranks agree on the first
        # error before any other collective, so that every rank stops with the same line.
        problem = None
        try:
            tag_dir, ckpt_meta = check_resumable(Path(args.resume_from_checkpoint), model_fingerprint(model),
                                                 world, rank, model_architecture(model), tp)
            resume.check_resumed_plan(tag_dir, ckpt_meta, plan, settings)
            stage = int((ds_cfg.get("zero_optimization") or {}).get("stage", 0))
            check_universal_batch(tag_dir, ckpt_meta, micro_bs * ga * world_d, micro_bs, ga, world_d, stage)
            data = ckpt_meta.get("data")
            if not isinstance(data, dict):
                raise CheckpointError(f"{tag_dir / META_FILE}: field 'data' missing: the checkpoint records no "
                                      f"data stream position (launch/train.py's checkpoints do)")
            if not is_universal(ckpt_meta) and data.get("global_batch_size", micro_bs * world_d) != \
                    micro_bs * world_d:  # only a universal checkpoint records the whole global batch
                raise CheckpointError(f"{tag_dir / META_FILE}: data.global_batch_size is "
                                      f"{data['global_batch_size']}, but this run's per-device batch x "
                                      f"data-parallel ranks is {micro_bs} x {world_d}; resume with the same")
            try:  # the training stream goes on from the saved position (read nowhere before the first step)
                stream.load_state_dict(data)
            except ValueError as err:
                raise CheckpointError(f"{tag_dir / META_FILE}: field 'data': {err}") from None
        except CheckpointError as err:
            problem = str(err)
        problem = sdist.first_error(problem)
        if problem:
            raise UserError(problem, all_ranks=True)
        if rank == 0 and "files" not in ckpt_meta:
            print(f"snip_ds: {tag_dir / META_FILE} records no checksums (written by an older snip_ds): "
                  f"its files are not verified", flush=True)
        saved = resume.checkpoint_schedule(ckpt_meta, raw_cfg, args, on_gpu, world)
        ds_cfg, schedule_line = resume.resume_schedule(ds_cfg, saved, args.reset_lr_schedule)
        ds_cfg = with_load_universal(ds_cfg, ckpt_meta)  # another world size: DeepSpeed reads zero/

    out_dir = Path(t.output_dir)
    global _logger
    logger = _logger = make_logger(out_dir / "tensorboard", rank)
    # Private streams (their own seeds) feed the statistics and the measured divergence of an adaptive run, so
    # neither shifts the training data.
    collect_stream = measure_stream = None
    if settings.is_adaptive:
        collect_stream = DataStream(train_ds, micro_bs, seed=t.seed + STATS_SEED_OFFSET, rank=rank_d,
                                    world_size=world_d)
        measure_stream = DataStream(train_ds, micro_bs, seed=t.seed + MEASURE_SEED_OFFSET, rank=rank_d,
                                    world_size=world_d)
    engine = initialize(model, ds_cfg, settings, tokens_per_step=tokens_per_step, logger=logger, seed=t.seed,
                        plan=plan, statistics_stream=collect_stream, measurement_stream=measure_stream)
    logger.text("run/config", config_text({"snip": settings.to_dict(), "deepspeed": ds_cfg, "data": data_info,
                                           "world_size": world, "tensor_parallel": tp}), 0)
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    if rank == 0:
        pairs = sum(not isinstance(i, LayerInfo) for i in engine.infos.values())
        layers = f"{len(engine.infos) - pairs} quantizable linears" + (
            f" and {pairs} (expert, projection) pairs" if pairs else "")
        print(f"snip_ds: {n_params / 1e6:.1f}M parameters, {layers}, "
              f"{world} rank(s){f' (tensor parallel {tp} x data parallel {world_d})' if tp > 1 else ''}, "
              f"plan {_plan_words(settings, engine)}, "
              f"{data_info.get('train_blocks', len(train_ds))} train blocks of {t.block_size} tokens, "
              f"GEMM backends: {backend_words}", flush=True)

    planner = engine.planner
    engine.state.show_dir = str(out_dir)  # named in each re-plan's line

    if args.resume_from_checkpoint:
        try:  # DeepSpeed's state, then SNIP's (plan, planner, streams, generators); the data's position is set
            engine.load_checkpoint(args.resume_from_checkpoint)
        except (CheckpointError, KeyError, ValueError) as err:  # a corrupt file inside a complete checkpoint
            raise UserError(f"{args.resume_from_checkpoint}: cannot be restored ({err})") from None
        if rank == 0:
            print(f"snip_ds: resumed from {args.resume_from_checkpoint} at step {engine.step}" + (
                f" (universal, saved by {ckpt_meta['world_size']} rank(s), resumed by {world})"
                if is_universal(ckpt_meta) else ""), flush=True)
            print(schedule_line, flush=True)
    if compile_backend is not None:  # the module compiled in place (its state dict's keys unchanged)
        engine.ds.compile(backend=compile_backend,
                          compile_kwargs={"mode": t.torch_compile_mode} if t.torch_compile_mode else {})
        if rank == 0:
            print(f"snip_ds: torch.compile, backend {compile_backend}"
                  f"{f', mode {t.torch_compile_mode}' if t.torch_compile_mode else ''}: the first step compiles, "
                  f"as does the first after a re-plan that changes a layer's precision", flush=True)
    if planner is None or planner.planned_at is not None:  # not adaptive's placeholder plan
        _write_artifacts(out_dir, engine.plan, planner.last_stats if planner else None)

    stop = StopFlag()
    stop.install()
    ckpt_dir = out_dir / "checkpoints"
    start_step = engine.step  # a resumed run's, restored
    progress = Progress(t.max_steps, engine.step, console_interval(t.logging_steps), tokens_per_step * world_d,
                        bar=not args.no_progress, show=rank == 0)
    last_checkpoint: Optional[str] = None

    def save() -> None:
        nonlocal last_checkpoint
        extra = {"data": stream.state_dict(), "lr_schedule": ds_cfg.get("scheduler"), "tokenizer": tokenizer,
                 "settings": settings.to_dict()}
        try:
            path = engine.save_checkpoint(ckpt_dir, extra)
        except CheckpointSaveError as err:
            raise RunFault(str(err)) from None
        last_checkpoint = str(path)
        if rank == 0:
            console.say(f"snip_ds: checkpoint saved to {path}")

    last_loss = val = math.nan
    while engine.step < t.max_steps:
        micro_batches = [stream.next_batch() for _ in range(ga)]
        history = len(planner.history) if planner is not None else 0
        start = time.perf_counter()
        try:
            last_loss = engine.train_step(micro_batches)  # re-plans first when due (adaptive)
        except NonFiniteError as err:  # snip.nonfinite "stop": before the step's update, nothing saved
            raise RunFault(str(err)) from None
        elapsed = time.perf_counter() - start
        progress.step(engine.step, last_loss, elapsed, engine.state.snip_seconds)
        if planner is not None and len(planner.history) > history:  # step time without the re-plan
            elapsed -= planner.history[-1]["collect_s"] + planner.history[-1]["solve_s"]
            _write_artifacts(out_dir, engine.plan, planner.last_stats)
        step = engine.step
        if step % t.logging_steps == 0:
            # the mean over the logging interval, as the Trainer logs it (console_interval is logging_steps then);
            # the FP4 share unless a re-plan at this step (before the next) logs its own: one value per step
            replans = planner is not None and step < t.max_steps and planner.due(step) and planner.planned_at != step
            logger.scalars({"train/loss": progress.mean_loss() if t.logging_steps > 1 else last_loss,
                            "train/lr": engine.lr(), "perf/step_time_s": elapsed,
                            "perf/tokens_per_s": tokens_per_step * world_d / elapsed,
                            **({} if replans else {"plan/fp4_share": engine.plan_fp4_share()})}, step)
        if step % t.eval_steps == 0 or step == t.max_steps:
            val = engine.evaluate(eval_batches)
            logger.scalars({"eval/loss": val, "eval/perplexity": math.exp(min(val, 50.0))}, step)
            if rank == 0:
                console.say(f"snip_ds: step {step} train loss {progress.mean_loss():.4f} ("
                            f"{over_steps(len(progress.losses))}) validation loss {val:.4f}")
        if (t.save_steps and step % t.save_steps == 0) or step == t.max_steps:
            save()
        if sdist.dist_max_flag(stop.is_set()):
            if not (t.save_steps and step % t.save_steps == 0) and step != t.max_steps:
                save()
            if rank == 0:
                console.say(f"snip_ds: stopped by {stop.reason} at step {step}; resume with "
                            f"--resume_from_checkpoint {ckpt_dir}")
            break
    progress.close()
    from snip_ds.report.run_summary import emulation_note, finish

    fp8_hardware = on_gpu and torch.cuda.get_device_capability() >= (8, 9)
    finish(engine.state, start_step=start_step, progress=progress, out_dir=out_dir, checkpoint=last_checkpoint,
           final_loss=val, emulation=emulation_note(gemm_device.type, backends, fp8_hardware))
    logger.close()
    return 0


_logger = None  # the TensorBoard logger of the run under way in this process (closed by main, however it ends)


def _close_logger() -> None:
    """Flushes and closes the run's TensorBoard event file: also when the run stops on an error (a lost peer,
    a fault), so that what it logged before the stop is on disk. Needs no other rank."""
    global _logger
    logger, _logger = _logger, None
    if logger is not None:
        logger.close()


def _lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is a collective that failed because another rank died (its connections closed) or
    stopped answering (the process group's timeout, ``--dist_timeout``)."""
    from snip_ds.runtime.distributed import lost_peer

    return lost_peer(err)


def main(argv: Optional[List[str]] = None, keep_process_group: bool = False) -> int:
    """Runs launch/train.py's training with ``argv``; returns the exit code. The process group is destroyed at
    the end (with DeepSpeed's references to it, :func:`snip_ds.engine.destroy_distributed`) unless
    ``keep_process_group`` (a caller that runs several trainings in one process on one group, as
    benchmarks/bench_train.py does)."""
    args = build_parser().parse_args(argv)
    quiet_third_party()  # before DeepSpeed and transformers are imported: messages a user cannot act on
    import torch.distributed as dist

    from snip_ds.runtime import distributed as sdist

    lost = False
    try:
        code = train(args)
    except (UserError, ConfigError) as err:
        if sdist.rank() == 0 or getattr(err, "all_ranks", False):
            sys.stderr.write(f"error: {err}\n")  # one write: ranks sharing a terminal do not interleave
            sys.stderr.flush()
        code = err.code if isinstance(err, UserError) else 2
    except Exception as err:
        if not _lost_peer(err):
            raise
        # Another rank died or hangs: this rank cannot go on, and every rank stops the same way (exit 1),
        # its TensorBoard scalars flushed first.
        _close_logger()
        sys.stderr.write(sdist.lost_peer_line(err, "resume it from its last complete checkpoint with "
                                                   "--resume_from_checkpoint OUTPUT_DIR") + "\n")
        sys.stderr.flush()
        code, lost = 1, True
    finally:
        _close_logger()
        console.detach()  # a failed run's bar must not catch a later in-process run's messages
    if lost:  # no collective (barrier, the group's teardown) can complete without the lost rank
        return code
    if dist.is_initialized() and not keep_process_group:
        from snip_ds.engine import destroy_distributed  # imported already: it set the process group up

        if code == 0:
            dist.barrier()
        destroy_distributed()
    return code
