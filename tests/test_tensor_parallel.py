"""Tensor parallelism (DeepSpeed AutoTP x ZeRO): real multi-process runs of tests/dist_scripts/tp_loop.py and
launch/train.py under the launcher (tests/launch_ranks.py), and the checks that refuse what it does not run."""
import json
import math
import subprocess
import sys

import pytest
import torch

from train_utils import REPO, TINY_MODEL, env, launch, ranks_cmd, run_ranks, scalars

SCRIPT = REPO / "tests" / "dist_scripts" / "tp_loop.py"
SHORT_TRAIN = ["--block_size", "64", "--eval_batches", "1", "--per_device_train_batch_size", "2"]
NO_SR = json.dumps({"quant": {"stochastic_rounding": False}})
ADAPTIVE = json.dumps({"replan_every": 2, "efficiency_saving": 0.5, "additional_bf16_fwd_every_n_steps": 0})


def _run(tmp_path, name: str, ranks: int, *args) -> list:
    """tp_loop.py on ``ranks`` ranks (one rank: a plain process); each rank's JSON."""
    out = tmp_path / name
    if ranks == 1:
        proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], cwd=REPO, env=env(),
                              capture_output=True, text=True, timeout=300)
    else:
        proc = run_ranks(lambda: ranks_cmd(SCRIPT, ["--out", out, *args], ranks), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads((tmp_path / f"{name}.{r}").read_text()) for r in range(ranks)]


# ----------------------------------------------------------------------------------------- in-process checks
def test_shard_widths_must_hold_whole_blocks_of_every_recipe():
    from snip_ds.engine.tensor_parallel import block_multiple
    from snip_ds.quant_config import QuantConfig

    assert block_multiple(QuantConfig()) == 16  # NVFP4's 16-element blocks (and 16x16 weight tiles)
    assert block_multiple(QuantConfig(fp4_recipe="mxfp4")) == 32
    assert block_multiple(QuantConfig(fp8_recipe="mxfp8", fp4_recipe="nvfp4")) == 32


def test_deepspeed_versions_outside_the_known_range_are_refused():
    from snip_ds.engine.tensor_parallel import check_deepspeed_version
    from snip_ds.config.settings import ConfigError

    check_deepspeed_version("0.19.8")
    for version in ("0.18.4", "0.20.0", "1.0", "unknown"):
        with pytest.raises(ConfigError, match=rf"this is DeepSpeed {version}; install deepspeed==0\.19\.\*"):
            check_deepspeed_version(version)


@pytest.mark.parametrize("snip, field", [
    ({"research": {"estimator": "empirical"}}, "snip.research.estimator: 'empirical'"),
    ({"research": {"fld_form": "channel"}}, "snip.research.fld_form: 'channel'"),
    ({"per_gemm": True, "research": {"dgrad_cost": "upstream"}}, "snip.research.dgrad_cost: 'upstream'"),
    ({"research": {"study_fields": ["quant_err"]}}, "snip.research.study_fields"),
])
def test_statistics_variants_that_are_not_sums_of_shards_are_refused(snip, field):
    from transformers import LlamaConfig, LlamaForCausalLM

    from snip_ds.engine.tensor_parallel import check_model
    from snip_ds.config.settings import ConfigError, parse_snip_section
    from snip_ds.swap import layer_infos

    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY_MODEL.items() if k != "model_type"}))
    infos = layer_infos(model)
    check_model(infos, parse_snip_section({}, "x"))  # the defaults run
    with pytest.raises(ConfigError, match=rf"^{field}.*tensor parallelism"):
        check_model(infos, parse_snip_section(snip, "x"))


@pytest.mark.parametrize("field, value", [("num_attention_heads", 5), ("num_key_value_heads", 3),
                                          ("intermediate_size", 99)])
def test_a_degree_that_does_not_divide_heads_or_widths_is_refused(field, value):
    """Read from the model's (text) config, before DeepSpeed would split them unevenly."""
    from types import SimpleNamespace

    from snip_ds.engine.tensor_parallel import check_model
    from snip_ds.config.settings import ConfigError, parse_snip_section

    fits = {"num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 128}
    check_model({}, parse_snip_section({}, "x"), SimpleNamespace(**fits), tp=2)
    check_model({}, parse_snip_section({}, "x"), SimpleNamespace(**{**fits, field: value}), tp=1)
    nested = SimpleNamespace(text_config=SimpleNamespace(**{**fits, field: value}))  # a multimodal config
    for config in (SimpleNamespace(**{**fits, field: value}), nested):
        with pytest.raises(ConfigError, match=rf"^tensor_parallel.autotp_size: 2 does not divide the model's "
                                              rf"{field} \({value}\)"):
            check_model({}, parse_snip_section({}, "x"), config, tp=2)


def test_mixture_of_experts_models_are_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    from train_utils import TINY_MIXTRAL
    from snip_ds.engine.tensor_parallel import check_model
    from snip_ds.config.settings import ConfigError, parse_snip_section
    from snip_ds.swap import layer_infos

    cfg = dict(TINY_MIXTRAL)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    with pytest.raises(ConfigError, match=r"layer model.layers.0.mlp.experts is a Mixture-of-Experts experts module"):
        check_model(layer_infos(model), parse_snip_section({}, "x"))


# ----------------------------------------------------------------------------------------- real runs

@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("fp8_recipe, fp4_recipe", [("fp8_hybrid", "nvfp4"), ("mxfp8", "mxfp4")])
def test_each_shard_computes_what_the_whole_layer_computes(tmp_path, fp8_recipe, fp4_recipe):
    """TP = 2, every layer at fp8 and fp4, on the same random X and G_Y as one whole SnipLinear of the gathered
    weight: output, input gradient and weight gradient (gathered) differ from the whole layer's by at most the
    round-off of summing the same products in another order (tp_loop.check_layers: ``γ_{K+2}|Q(A)||Q(B)|``).
    Scales from a shard's own amax instead of the whole tensor's exceed that bound ~10⁴-fold (checked by hand)."""
    ranks = _run(tmp_path, "layers", 2, "--tp", "2", "--zero", "0", "--fp8_recipe", fp8_recipe,
                 "--fp4_recipe", fp4_recipe, "--snip", NO_SR, "--check_layers")
    layers = ranks[0]["layers"]
    assert len(layers) == 2 * 14  # 2 blocks x 7 linears x (fp8, fp4)
    for name, rec in layers.items():
        assert rec["worst"] <= 1.0, (name, rec)
    assert ranks[0]["layers"] == ranks[1]["layers"]


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_trains_and_measures_like_tp1(tmp_path):
    """The same global batches at TP = 2 on 2 ranks and TP = 1 on 1 rank, ZeRO-1.

    * bf16 and fp8: losses equal to FP32 round-off (1e-5 relative; measured ≤ 1.1e-7: the row-parallel
      all-reduce sums partial products in another order, and FP8 products of such small K are exact);
    * every TP layer is a quantized shard and ran its three GEMMs at the plan's precision, as many as at TP = 1;
    * fp4 (stochastic rounding off): one statistics collection agrees within 1e-2 relative and the losses
      within 2e-2. Not round-off: FP4's grid is coarse, so a one-ulp difference of an input (the reduction
      order above) flips a few elements to the neighbouring FP4 value (measured: 2e-4 in the statistics, 1e-2
      in the third loss); the layer test above checks each shard's GEMMs to round-off instead.
    """
    from concurrent.futures import ThreadPoolExecutor

    plans = {"bf16": (), "fp8": (), "fp4": ("--collect", "--snip", NO_SR)}
    with ThreadPoolExecutor(max_workers=2) as pool:  # the one-rank runs (one thread each) two at a time
        ones = dict(zip(plans, pool.map(lambda p: _run(tmp_path, f"{p}1", 1, "--plan", p, *plans[p]), plans)))
    runs = {p: (ones[p], _run(tmp_path, f"{p}2", 2, "--tp", "2", "--plan", p, *extra)) for p, extra in plans.items()}
    for plan, (one, two) in runs.items():
        assert two[0]["losses"] == two[1]["losses"] and two[0]["dp_size"] == 1
        rel = 1e-5 if plan != "fp4" else 2e-2
        for a, b in zip(one[0]["losses"], two[0]["losses"]):
            assert b == pytest.approx(a, rel=rel), plan
        assert two[0]["gemms"] == one[0]["gemms"]
        expected = {} if plan == "bf16" else {f"{g}:{plan}": 14 * 3 for g in ("fprop", "dgrad", "wgrad")}
        assert two[0]["gemms"] == expected
        for fqn, (cls, precision, shape) in two[0]["layers"].items():
            assert cls == ("SnipRowParallel" if fqn.endswith(("o_proj", "down_proj")) else "SnipColumnParallel")
            assert precision == plan
            assert shape != one[0]["layers"][fqn][2]  # a shard
    one, two = runs["fp4"][0][0]["stats"], runs["fp4"][1][0]["stats"]
    assert one.keys() == two.keys()
    for fqn in one:
        for field in ("fld", "bwd"):
            for p in ("fp8", "fp4"):
                assert two[fqn][field][p] == pytest.approx(one[fqn][field][p], rel=1e-2), (fqn, field, p)


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_dp2_adaptive_saves_resumes_bit_for_bit_and_resumes_at_other_shapes(tmp_path):
    """TP 2 x DP 2 on 4 ranks, ZeRO-1, adaptive (re-plans at steps 0, 2 and 4): 5 steps uninterrupted, saving
    after step 3, and a new run resumed from that checkpoint for the last 2: the same losses, plan and
    parameters bit for bit. The checkpoint converted by
    ``snip-ds universal`` resumes at TP 1 x DP 2 and, with the same global batch (micro-batch 4), at TP 2 x DP 1
    and on 1 rank: step and re-plan history continue as saved, and the first resumed step (under the restored
    plan) continues the uninterrupted run within round-off where its micro-batches are the same (TP 1 x DP 2),
    and agrees across TP degrees where they are not (TP 2 x DP 1 against one rank)."""
    from snip_ds.engine.universal import convert_to_universal

    base = ("--tp", "2", "--plan", "adaptive", "--snip", ADAPTIVE)
    whole = _run(tmp_path, "whole", 4, *base, "--steps", "5", "--save", str(tmp_path / "ckpt"), "--save_at", "3")
    resumed = _run(tmp_path, "resumed", 4, *base, "--steps", "2", "--skip", "3", "--resume", str(tmp_path / "ckpt"))
    for w, r in zip(whole, resumed):
        assert w["history"] == r["history"] == [0, 2, 4] and r["losses"] == w["losses"][3:]
        assert r["param_sum"] == w["param_sum"] and r["plan"] == w["plan"]
    meta = json.loads((tmp_path / "ckpt" / "step_3" / "snip_meta.json").read_text())
    assert meta["tensor_parallel"] == 2 and meta["world_size"] == 4
    _export_matches(tmp_path, whole[0]["bf16_loss"])
    _serves_like_an_unsharded_checkpoint(tmp_path)
    # the checkpoint at another shape without conversion: refused, naming the field
    (refused,) = _run(tmp_path, "refused", 1, "--plan", "adaptive", "--snip", ADAPTIVE, "--micro", "4", "--steps",
                      "1", "--resume", str(tmp_path / "ckpt"))
    assert "tensor_parallel is 2, but this run's tensor_parallel.autotp_size is 1" in refused["error"]

    universal = convert_to_universal(tmp_path / "ckpt" / "step_3", tmp_path / "universal", log=lambda m: None)
    first = {}
    for name, ranks, args in (("tp1dp2", 2, ("--tp", "1")), ("tp2dp1", 2, ("--tp", "2", "--micro", "4")),
                              ("tp1dp1", 1, ("--micro", "4"))):
        out = _run(tmp_path, name, ranks, "--plan", "adaptive", "--snip", ADAPTIVE, "--steps", "2", "--skip", "3",
                   "--resume", str(universal), *args)
        for r in out:
            assert r["step"] == 5 and r["history"] == [0, 2, 4], name
            assert all(math.isfinite(x) for x in r["losses"]) and r["losses"][0] == out[0]["losses"][0]
        first[name] = out[0]["losses"][0]
    # Step 4 trains under the restored step-2 plan, from the same FP32 weights and Adam state (the conversion
    # copies them), on the same global batch. Its loss (the global batch's) comes before any update, so where the
    # micro-batches are the same (and so every per-tensor scale, taken per micro-batch) only the order of summation
    # differs: the row-parallel all-reduce or its absence, FP32 round-off of K <= 256 products, < 256 * 2^-24 =
    # 1.5e-5 relative per sum, and the FP4/FP8 elements a one-ulp input difference moves to their neighbours;
    # 1e-4 absorbs both. That is TP 1 x DP 2 against the uninterrupted run, and TP 2 x DP 1 against one rank
    # (micro-batches of 4: other scales than the saving run's, measured 8e-4 away from it).
    assert first["tp1dp2"] == pytest.approx(whole[0]["losses"][3], rel=1e-4)
    assert first["tp2dp1"] == pytest.approx(first["tp1dp1"], rel=1e-4)


def _export_matches(tmp_path, bf16_loss: float) -> None:
    """``snip-ds export`` of the TP 2 x DP 2 checkpoint merges the shards into the plain Hugging Face model: its
    loss on the batch the saving run measured unquantized equals that run's to FP32 round-off (1e-5 relative:
    the same weights, the row-parallel sums in another order)."""
    from transformers import AutoModelForCausalLM

    from snip_ds.export import export_checkpoint

    record = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    assert record["tensor_parallel"] == 2 and record["world_size"] == 4
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    gen = torch.Generator().manual_seed(100)  # tp_loop.py's batches: rank 0's slice of the fourth global batch
    ids = [torch.randint(0, 96, (2 * 2, 16), generator=gen) for _ in range(4)][-1][:2]
    with torch.no_grad():
        loss = float(model(input_ids=ids, labels=ids).loss)
    assert loss == pytest.approx(bf16_loss, rel=1e-5)


def _serves_like_an_unsharded_checkpoint(tmp_path) -> None:
    """``snip-ds export --format compressed-tensors`` of the TP 2 x DP 2 checkpoint (after :func:`_export_matches`,
    whose ``hf`` export holds its merged FP32 masters). A run of the user's own loop records no training data,
    so the NVFP4 activation scales need ``--calibration-data``: without it, one line naming the flag; with
    tp_loop.py's own batches as token ids, the compressed checkpoint equals, tensor for tensor, the one exported
    from an unsharded checkpoint of the same weights, plan and settings (a Trainer ``checkpoint-N``), and
    transformers' forward of it follows snip_ds's planned forward within the plan's quantization effect (the
    plain runs' check, tests/test_export_serve.py)."""
    pytest.importorskip("compressed_tensors")
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from snip_ds.export import export_checkpoint
    from snip_ds.export.files import ExportError
    from snip_ds.export.serve import ServeOptions
    from test_export_serve import _planned_logits, _served

    ct = ServeOptions(format="compressed-tensors")
    with pytest.raises(ExportError, match="the run recorded no training data .*; pass --calibration-data PATH"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "ct_none", serve=ct)
    gen = torch.Generator().manual_seed(100)  # tp_loop.py's global batches of 2 x 2 blocks
    ids = torch.cat([torch.randint(0, 96, (2 * 2, 16), generator=gen) for _ in range(4)])
    save_file({"input_ids": ids}, str(tmp_path / "ids.safetensors"))
    ct = ServeOptions(format="compressed-tensors", calibration_data=str(tmp_path / "ids.safetensors"))
    sharded = export_checkpoint(tmp_path / "ckpt", tmp_path / "ct", serve=ct)
    assert sharded["tensor_parallel"] == 2 and sharded["schemes"].get("nvfp4", 0) > 0
    assert sharded["calibration"]["batches"] == 8 and sharded["calibration"]["block_size"] == 16

    state = json.loads((tmp_path / "ckpt" / "step_3" / "snip_state.json").read_text())
    whole = tmp_path / "unsharded" / "checkpoint-3"
    whole.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (whole / name).write_bytes((tmp_path / "hf" / name).read_bytes())
    (whole / "snip_state.json").write_text(json.dumps({**{k: state[k] for k in ("format", "step", "settings",
                                                                               "plan", "planner")},
                                                      "driver": "trainer", "world_size": 1}))
    unsharded = export_checkpoint(whole, tmp_path / "ct_whole", serve=ct)
    assert unsharded["tensor_parallel"] == 1 and unsharded["calibration"] == sharded["calibration"]
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("ct", "ct_whole"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    config = [json.loads((tmp_path / d / "config.json").read_text())["quantization_config"] for d in ("ct", "ct_whole")]
    assert config[0] == config[1]

    masters = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    batch = ids[-4:]
    planned = _planned_logits(masters, state["plan"]["assignment"], batch)
    with torch.no_grad():
        effect = (planned - masters(input_ids=batch).logits).abs().max()
        assert (_served(tmp_path / "ct", torch.float32)(input_ids=batch).logits - planned).abs().max() < effect


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_dp2_zero3_replans_saves_and_resumes_bit_for_bit(tmp_path):
    """TP 2 x DP 2 on 4 ranks under ZeRO-3: adaptive SNIP re-plans at steps 0 and 2, one plan on every rank; 4
    steps saving after step 2, and a new run resumed from that checkpoint for the last 2: the same losses, plan
    and parameters bit for bit."""
    base = ("--tp", "2", "--zero", "3", "--plan", "adaptive", "--snip", ADAPTIVE)
    whole = _run(tmp_path, "whole", 4, *base, "--steps", "4", "--save", str(tmp_path / "ckpt"), "--save_at", "2")
    assert all(r["history"] == [0, 2] and r["plan"] == whole[0]["plan"] for r in whole)
    assert all(r["losses"] == whole[0]["losses"] and all(math.isfinite(x) for x in r["losses"]) for r in whole)
    resumed = _run(tmp_path, "resumed", 4, *base, "--steps", "2", "--skip", "2", "--resume", str(tmp_path / "ckpt"))
    for w, r in zip(whole, resumed):
        assert r["losses"] == w["losses"][2:] and r["param_sum"] == w["param_sum"] and r["plan"] == w["plan"]
        assert r["history"] == [0, 2]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_shard_that_splits_a_block_is_refused_naming_the_layer(tmp_path):
    """Hidden 64 with 4 heads, 2 KV heads: k_proj's 32 rows split into shards of 16, which MXFP4's blocks of 32
    would straddle."""
    ranks = _run(tmp_path, "blocks", 2, "--tp", "2", "--hidden", "64", "--fp4_recipe", "mxfp4")
    for r in ranks:
        assert ("layer model.layers.0.self_attn.k_proj: tensor parallelism splits its output features (rows of W) "
                "into shards of [16, 16], not multiples of 32") in r["error"]


@pytest.mark.slow
@pytest.mark.distributed
def test_launch_train_runs_the_shipped_tp_config_and_resumes(tmp_path):
    """``deepspeed --num_gpus 2 launch/train.py --deepspeed ds_configs/zero3_tp2.json`` unchanged (TP 2, ZeRO-3,
    adaptive), 4 steps saving at 2 and 4; then resumed from step 2 to 4: the same step-4 validation loss."""
    (tmp_path / "model.json").write_text(json.dumps(TINY_MODEL))
    common = ["--deepspeed", str(REPO / "ds_configs" / "zero3_tp2.json"), "--model_config",
              str(tmp_path / "model.json"), *SHORT_TRAIN, "--max_steps", "4", "--eval_steps", "2", "--save_steps",
              "2", "--no_progress"]
    first = launch([*common, "--output_dir", str(tmp_path / "a")], num_ranks=2)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "2 rank(s) (tensor parallel 2 x data parallel 1)" in first.stdout
    again = launch([*common, "--output_dir", str(tmp_path / "b"), "--resume_from_checkpoint",
                    str(tmp_path / "a" / "checkpoints" / "step_2")], num_ranks=2)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    a, b = scalars(tmp_path / "a" / "tensorboard"), scalars(tmp_path / "b" / "tensorboard")
    assert b["eval/loss"][4] == a["eval/loss"][4]


# ----------------------------------------------------------------------------------------- the Trainer
HF_SCRIPT = REPO / "tests" / "dist_scripts" / "hf_tp.py"


def _hf(tmp_path, name: str, ranks: int, *args) -> list:
    """hf_tp.py (add_snip(trainer)) on ``ranks`` ranks under the launcher (tests/launch_ranks.py); each rank's JSON."""
    out = tmp_path / name
    proc = run_ranks(lambda: ranks_cmd(HF_SCRIPT, ["--out", out, "--output_dir", tmp_path / f"{name}_run", *args],
                                       ranks), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads((tmp_path / f"{name}.{r}").read_text()) for r in range(ranks)]


@pytest.mark.slow
@pytest.mark.distributed
def test_trainer_tp2_trains_like_tp1(tmp_path):
    """``add_snip(trainer)`` with ``autotp_size: 2``, a fixed fp8 plan: TP 2 on 2 ranks under ZeRO-1, and under
    ZeRO-3 with the model built after ``TrainingArguments`` (by its constructor, which transformers does not wrap
    in zero.Init: ``from_config`` and ``from_pretrained`` do, as run_clm.py builds it, tests/test_hf.py), against
    TP 1 on 1 rank, the same batches: losses equal to FP32 round-off (1e-5 relative, as in the own loop's test
    above); every TP layer is a quantized shard that ran its three GEMMs at fp8, as many as at TP 1. Their
    checkpoints record that no zero.Init partitioned the model, and ``snip-ds universal`` refuses them up front
    (the Trainer resumes its own at the saved shape)."""
    from snip_ds.engine.checkpoint_layout import CheckpointError
    from snip_ds.engine.universal import convert_to_universal

    (one,) = _hf(tmp_path, "tp1", 1, "--plan", "fp8")
    for name, extra in (("zero1", ()), ("zero3", ("--zero", "3", "--zero_init"))):
        two = _hf(tmp_path, name, 2, "--tp", "2", "--plan", "fp8", "--save_steps", "3", *extra)
        ckpt = tmp_path / f"{name}_run" / "checkpoint-3"
        assert json.loads((ckpt / "snip_state.json").read_text())["zero_init"] is False
        with pytest.raises(CheckpointError, match="the Trainer resumes its own only at the shape it was saved at"):
            convert_to_universal(ckpt, tmp_path / f"{name}_universal")
        assert two[0]["losses"] == two[1]["losses"] and two[0]["dp_size"] == 1, name
        assert len(two[0]["losses"]) == 3
        for a, b in zip(one["losses"], two[0]["losses"]):
            assert b == pytest.approx(a, rel=1e-5), name
        assert two[0]["gemms"] == one["gemms"] == {f"{g}:fp8": 14 * 3 for g in ("fprop", "dgrad", "wgrad")}
        for fqn, (cls, precision, shape) in two[0]["layers"].items():
            assert cls == ("SnipRowParallel" if fqn.endswith(("o_proj", "down_proj")) else "SnipColumnParallel")
            assert precision == "fp8" and one["layers"][fqn][1] == "fp8"
            axis = 1 if cls == "SnipRowParallel" else 0
            assert shape[axis] * 2 == one["layers"][fqn][2][axis], (name, fqn)  # half of the whole layer


@pytest.mark.slow
@pytest.mark.distributed
def test_trainer_tp2_dp2_adaptive_resumes_bit_for_bit_and_exports(tmp_path):
    """The Trainer at TP 2 x DP 2 on 4 ranks, ZeRO-1, adaptive (re-plans at steps 0, 2, 4), saving at step 3:
    its first plan is TP 1 x DP 2's (the statistics do not depend on the degree); resumed from checkpoint-3
    (``trainer.train(resume_from_checkpoint=...)``) it continues bit for bit (losses, parameters, plans); a resume
    at another degree is refused naming the checkpoint before DeepSpeed reads it; ``snip-ds export`` of the
    checkpoint reads the Trainer's gathered model.safetensors, and without it DeepSpeed's FP32 masters with
    the shards merged: the same weights exactly (an FP32 run: the module's weights are the masters)."""
    import shutil

    from snip_ds.export import export_checkpoint

    adaptive = ("--plan", "adaptive", "--snip", ADAPTIVE)
    base = (*adaptive, "--max_steps", "5", "--save_steps", "3", "--gather")
    whole = _hf(tmp_path, "whole", 4, "--tp", "2", *base)
    (dp_only, _) = _hf(tmp_path, "dp", 2, *adaptive, "--max_steps", "1")
    assert whole[0]["plans"][0] == dp_only["plans"][0]
    assert whole[0]["losses"][0] == pytest.approx(dp_only["losses"][0], rel=1e-5)
    ckpt = tmp_path / "whole_run" / "checkpoint-3"
    resumed = _hf(tmp_path, "resumed", 4, "--tp", "2", *base, "--resume", str(ckpt))
    for w, r in zip(whole, resumed):
        assert w["history"] == r["history"] == [0, 2, 4] and w["dp_size"] == 2
        assert r["losses"] == w["losses"] and r["param_sum"] == w["param_sum"] and r["plans"] == w["plans"][3:]
    assert json.loads((ckpt / "snip_state.json").read_text())["tensor_parallel"] == 2
    refused = _hf(tmp_path, "refused", 4, *base, "--resume", str(ckpt))
    for r in refused:
        assert r["error"] == (f"{ckpt / 'snip_state.json'}: saved by 4 rank(s) at tensor_parallel.autotp_size 2, "
                              f"this run has 4 rank(s) at 1: the Trainer resumes a DeepSpeed checkpoint at the "
                              f"shape it was saved at")

    gathered = export_checkpoint(ckpt, tmp_path / "hf_gathered")
    assert gathered["tensor_parallel"] == 2 and "gathered by DeepSpeed" in gathered["weights"]
    masters_only = tmp_path / "masters" / "checkpoint-3"
    shutil.copytree(ckpt, masters_only)
    (masters_only / "model.safetensors").unlink()
    merged = export_checkpoint(masters_only, tmp_path / "hf_merged")
    assert merged["weights"] == "DeepSpeed's FP32 master weights (global_step3, 2 tensor-parallel shards merged)"
    from safetensors.torch import load_file
    a, b = load_file(str(tmp_path / "hf_gathered" / "model.safetensors")), \
        load_file(str(tmp_path / "hf_merged" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
