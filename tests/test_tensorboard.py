"""The precision-map image TensorBoard shows: a labelled figure, one row of 7 cells per block, coloured by
precision, with the step and FP4 share in its title and a legend. The event file: records on disk as soon as
they are logged, and a failed write (a real file-size limit in a training process) reported once while
training goes on."""
import numpy as np
import pytest

from snip_ds.report.tensorboard import PRECISION_COLOURS, precision_map_figure, precision_map_image
from snip_ds.plan import fp4_share
from snip_ds.types import block_index

KINDS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _plan(blocks, pick):
    return {f"model.layers.{b}.{k}": pick(b, i) for b in range(blocks) for i, k in enumerate(KINDS)}


def _count(img, precision):
    """Pixels of exactly the precision's colour (cells are drawn without interpolation)."""
    return int(np.all(img.transpose(1, 2, 0) == PRECISION_COLOURS[precision], axis=-1).sum())


def test_image_reads_in_tensorboard_and_grows_with_the_model():
    small = precision_map_image(_plan(2, lambda b, i: "fp8"), block_index, step=0, fp4_share=0.0)
    large = precision_map_image(_plan(24, lambda b, i: "fp8"), block_index, step=0, fp4_share=0.0)
    assert small.dtype == np.uint8 and small.shape[0] == 3
    assert small.shape[2] >= 600 and small.shape[1] >= 200  # TensorBoard shows images at their own size
    assert large.shape[2] == small.shape[2] and large.shape[1] > small.shape[1] + 24 * 10  # >= 10 px a row


def test_cell_colours_follow_the_plan():
    """Moving layers from fp8 to fp4 moves pixels from the fp8 colour to the fp4 colour, in proportion to the
    number of cells. Each cell is drawn with the same size, give or take one pixel row and one column (its
    borders fall on a pixel grid): a cell is ~68 x 26 pixels, so the tolerance is 100 pixels per moved cell."""
    def pick(n_fp4):
        return lambda b, i: "fp4" if b * 7 + i < n_fp4 else "fp8"
    imgs = {n: precision_map_image(_plan(4, pick(n)), block_index, step=5, fp4_share=n / 28) for n in (0, 3, 6)}
    assert not np.array_equal(imgs[0], imgs[3])
    moved3 = _count(imgs[3], "fp4") - _count(imgs[0], "fp4")
    moved6 = _count(imgs[6], "fp4") - _count(imgs[0], "fp4")
    assert moved3 > 0 and moved3 == pytest.approx(_count(imgs[0], "fp8") - _count(imgs[3], "fp8"), abs=3 * 100)
    cell = moved3 / 3
    assert cell > 400  # a cell is larger than 20 x 20 pixels
    assert moved6 == pytest.approx(2 * moved3, abs=6 * 100)
    bf16 = precision_map_image(_plan(4, lambda b, i: "bf16" if i == 6 else "fp8"), block_index)
    assert _count(bf16, "bf16") - _count(imgs[0], "bf16") == pytest.approx(4 * cell, abs=4 * 100)


def test_figure_names_blocks_layers_step_share_and_precisions():
    plan = _plan(3, lambda b, i: "fp4" if i >= 4 else "fp8")
    flops = {fqn: 1.0 for fqn in plan}
    share = fp4_share(plan, flops)
    fig = precision_map_figure(plan, block_index, step=40, fp4_share=share, method="best")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["q", "k", "v", "o", "gate", "up", "down"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1", "2"]
    assert ax.get_ylabel() == "decoder block"
    title = ax.get_title()
    assert "step 40" in title and f"FP4 share {100 * 9 / 21:.1f}%" in title and "best" in title
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["bf16", "fp8", "fp4"]


def test_per_gemm_plans_split_cells_and_say_so():
    plan = _plan(2, lambda b, i: {"fprop": "fp8", "dgrad": "fp4", "wgrad": "bf16"})
    fig = precision_map_figure(plan, block_index, step=1)
    (legend,) = fig.legends
    assert "fprop" in legend.get_title().get_text() and "wgrad" in legend.get_title().get_text()
    top = fig.axes[0].child_axes[0]  # the secondary x axis naming each stripe
    assert [t.get_text() for t in top.get_xticklabels()] == ["F", "D", "W"] * 7
    img = precision_map_image(plan, block_index, step=1)
    every = {p: precision_map_image(_plan(2, lambda b, i: p), block_index, step=1) for p in ("bf16", "fp8")}
    legend_only = {p: _count(every["bf16"], p) for p in ("fp8", "fp4")}  # no cell is fp8 or fp4 there
    cells = _count(every["fp8"], "fp8") - legend_only["fp8"]
    # each GEMM takes a third of every cell; the two thin white lines between the stripes (0.6 pt: 1-2 pixels
    # each, anti-aliased) take 2-4 of a cell's ~68 pixels of width, up to 6 %, from the stripes beside them
    assert _count(img, "fp8") - legend_only["fp8"] == pytest.approx(cells / 3, rel=0.08)
    assert _count(img, "fp4") - legend_only["fp4"] == pytest.approx(cells / 3, rel=0.08)
    assert _count(img, "bf16") - _count(every["fp8"], "bf16") == pytest.approx(cells / 3, rel=0.08)


def test_rendering_leaves_no_figure_for_the_garbage_collector():
    """Each rendered figure is freed before the image is returned, also while the collector does not run on
    its own (between the rare full collections of a long run): no Figure, and no pixel buffer, piles up."""
    import gc

    from matplotlib.figure import Figure

    def figures():
        return sum(isinstance(o, Figure) for o in gc.get_objects())

    gc.collect()
    before = figures()
    gc.disable()
    try:
        for step in range(3):
            precision_map_image(_plan(2, lambda b, i: "fp8"), block_index, step=step, fp4_share=0.0)
        assert figures() == before
    finally:
        gc.enable()


# ----------------------------------------------------------------------------------------------------------
# the event file: written as logged, and a failed write reported once while training goes on
# ----------------------------------------------------------------------------------------------------------

def test_logger_records_read_back_in_tensorboard(tmp_path):
    from train_utils import scalars
    from snip_ds.report.tensorboard import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path / "tb")
    logger.scalars({"train/loss": 2.5, "train/lr": 1e-3}, 1)
    logger.scalar("train/loss", 2.25, 2)
    img = precision_map_image(_plan(2, lambda b, i: "fp4" if i else "fp8"), block_index, step=3)
    logger.image("plan/map", img, 3)
    logger.text("run/config", "hello", 0)
    # on disk before close: what a process that stops now would leave
    assert scalars(tmp_path / "tb") == {"train/loss": {1: 2.5, 2: 2.25}, "train/lr": {1: np.float32(1e-3)}}
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    acc.Reload()
    (image,) = acc.Images("plan/map")
    assert image.step == 3 and (image.width, image.height) == (img.shape[2], img.shape[1])
    assert logger.error is None


_FULL_DISK_RUN = """
import os, resource, signal, sys
sys.path.insert(0, {repo!r})
import torch
import snip_ds
from snip_ds.report.tensorboard import make_logger
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
tb = {tb!r}
logger = make_logger(tb, 0)
config = {{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-2}}}}, "zero_optimization": {{"stage": 0}},
          "steps_per_print": 10 ** 9, "snip": {{"plan": "fp8", "train": {{"seed": 0}}}}}}
engine = snip_ds.initialize(model, config, tokens_per_step=32, logger=logger)
(event_file,) = os.listdir(tb)
# Everything the run loads is loaded (JIT-built ops included). From here no file may grow past the event file's
# size + 1200 bytes, as on a disk that fills up: the event file's writes fail after a few steps.
limit = os.path.getsize(os.path.join(tb, event_file)) + 1200
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
gen = torch.Generator().manual_seed(1)
for _ in range(30):
    ids = torch.randint(0, 64, (2, 16), generator=gen)
    loss = engine.train_step([{{"input_ids": ids, "labels": ids}}])
    logger.scalars({{"train/loss": loss}}, engine.step)
    print("LOSS", engine.step, repr(loss), flush=True)
logger.close()
print("FINISHED", engine.step, flush=True)
"""


@pytest.mark.slow
def test_a_full_disk_under_tensorboard_is_reported_once_and_training_goes_on(tmp_path):
    """A real training process (snip_ds.initialize, 30 steps) whose event file stops fitting after a few steps
    (RLIMIT_FSIZE, EFBIG as a full disk gives ENOSPC): one warning naming the directory and the cause, all 30
    steps trained, exit 0; the event file keeps the losses logged before the failure, exactly."""
    import subprocess
    import sys

    from train_utils import REPO, env, scalars

    tb = tmp_path / "tensorboard"
    proc = subprocess.run([sys.executable, "-c", _FULL_DISK_RUN.format(repo=str(REPO), tb=str(tb))], cwd=REPO,
                          env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "FINISHED 30"
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if "TensorBoard" in line]
    assert warnings == [f"snip_ds: warning: TensorBoard: cannot write to {tb} (File too large [errno 27]); later "
                        f"TensorBoard records of this run are dropped, training goes on"], warnings
    assert "Traceback" not in proc.stderr
    losses = {int(line.split()[1]): float(line.split()[2]) for line in proc.stdout.splitlines()
              if line.startswith("LOSS ")}
    logged = scalars(tb)["train/loss"]
    assert 1 <= len(logged) < 30 and sorted(logged) == list(range(1, len(logged) + 1))
    assert all(logged[s] == np.float32(losses[s]) for s in logged), (logged, losses)


def test_the_precision_map_is_rendered_only_where_a_logger_writes_images(monkeypatch):
    """Every rank applies each plan, but only the logging rank's logger writes images: the others (NullLogger)
    get the plan's scalar and never render its figure; a logger that writes images gets one map per change."""
    from types import SimpleNamespace

    from snip_ds.engine import state as state_module
    from snip_ds.config.model_settings import initial_plan
    from snip_ds.run.model import build_model
    from snip_ds.config.settings import SnipSettings
    from snip_ds.swap import swap_model
    from snip_ds.report.tensorboard import NullLogger

    rendered = []
    real = state_module.precision_map_image
    monkeypatch.setattr(state_module, "precision_map_image", lambda *a, **k: rendered.append(1) or real(*a, **k))

    class Recorder(NullLogger):
        def __init__(self, writes_images):
            self.writes_images, self.records = writes_images, []

        def scalar(self, tag, value, step):
            self.records.append(tag)

        def image(self, tag, chw, step):
            self.records.append(tag)

    model = build_model(None, {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "max_position_embeddings": 32}, vocab_size=64, seed=0, block_size=16)
    settings = SnipSettings(plan="fp8")
    infos = swap_model(model, "bf16", settings.quant, seed=0, rank=0)
    loop = SimpleNamespace(module=model, optimizer=None, step=0, zero_stage=0)
    for writes, maps in ((False, 0), (True, 1)):
        logger = Recorder(writes)
        snip = state_module.SnipState(loop, infos, settings, 16, logger, driver="engine")
        snip.set_plan(initial_plan(list(infos), {f: i.flops(16) for f, i in infos.items()}, settings), "initial plan")
        assert logger.records == ["plan/fp4_share"] + ["plan/precision_map"] * maps
        assert len(rendered) == maps
