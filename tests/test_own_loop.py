"""``snip_ds.initialize`` runs SNIP inside a user's own loop: real 2-rank ZeRO-3 runs of
tests/dist_scripts/own_loop.py through the launcher (tests/launch_ranks.py)."""
import json
import math
import subprocess
import sys

import pytest

from train_utils import REPO, env, ranks_cmd, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPT = REPO / "tests" / "dist_scripts" / "own_loop.py"


def _run(case: str, tmp_path, ranks: int = 2, extra=()) -> list:
    out = tmp_path / case
    proc = run_ranks(lambda: ranks_cmd(SCRIPT, ["--case", case, "--out", out, *extra], ranks), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads((tmp_path / f"{case}.{r}").read_text()) for r in range(ranks)]


def test_resume_from_restores_a_checkpoint_and_a_universal_one_at_another_number_of_ranks(tmp_path):
    """``snip_ds.initialize(..., resume_from=...)``: a 2-rank ZeRO-1 adaptive run saves at step 3. On 1 rank
    (accumulation 2: the same global batch) its own checkpoint is refused, naming the number of ranks; the
    universal one (``snip-ds universal``'s conversion) resumes: step, plan and re-plan history as saved, and
    the parameters exactly the saved ones (the same FP32 values, summed in the same order), then it trains."""
    from snip_ds.engine.universal import convert_to_universal

    saved = _run("save", tmp_path)
    assert saved[0]["step"] == 3 and saved[0]["sum"] == saved[1]["sum"] and saved[0]["digest"] == saved[1]["digest"]
    ckpt = tmp_path / "save.ckpt"
    (refused,) = _run("resume", tmp_path, ranks=1, extra=("--resume", str(ckpt)))
    assert "error" in refused and "2" in refused["error"] and "universal" in refused["error"], refused
    universal = convert_to_universal(ckpt / "step_3", tmp_path / "universal", log=lambda msg: None)
    (resumed,) = _run("resume", tmp_path, ranks=1, extra=("--resume", str(universal)))
    assert "error" not in resumed, resumed
    assert resumed["step"] == 3 and resumed["digest"] == saved[0]["digest"]
    assert resumed["history"] == saved[0]["history"] and [h["step"] for h in resumed["history"]] == [0, 2]
    assert resumed["sum"] == saved[0]["sum"]
    assert math.isfinite(resumed["loss"])


def test_adaptive_replans_on_schedule_with_the_same_plan_on_every_rank(tmp_path):
    ranks = _run("replan", tmp_path)
    for r in ranks:
        assert [h["step"] for h in r["history"]] == [0, 2, 4]
        assert all(h["status"] != "failed" for h in r["history"])
        assert r["method"] == "best"  # SNIP's own plan replaced the fp8 placeholder before step 1
        # the efficiency target holds at every step (1e-9: the FP64 share's round-off, ≤ 14·2^-53 ≈ 2e-15)
        assert all(s >= 0.5 - 1e-9 for s in r["shares"])
    assert ranks[0]["digests"] == ranks[1]["digests"]


def test_an_unsolvable_first_plan_stops_every_rank_with_the_reason(tmp_path):
    ranks = _run("first_unsolvable", tmp_path)
    for r in ranks:
        assert "first adaptive plan cannot be solved" in r["error"], r
    assert ranks[0]["error"] == ranks[1]["error"]


def test_a_failed_replan_keeps_the_plan_in_force_on_every_rank(tmp_path):
    """A real solve that fails: the re-plan at step 2 collects non-finite statistics (a NaN output on rank 1 in
    the collection's forward), so every layer is pinned to fp8 and the 0.5 FP4 target is out of reach."""
    ranks = _run("replan_fails", tmp_path)
    for r in ranks:
        assert [(h["step"], h["status"] == "failed") for h in r["history"]] == [(0, False), (2, True), (4, False)]
        assert r["digests"][1] == r["digests"][2]  # steps 2-3 ran on the plan solved at step 0
    assert ranks[0]["digests"] == ranks[1]["digests"]


def test_per_gemm_upstream_dgrad_plan_under_zero3_in_a_plain_process(tmp_path):
    """snip.per_gemm with research.dgrad_cost 'upstream' on ZeRO-3 (partitioned optimizer states, no retained
    graph): the collection estimates bwd_dgrad and the first plan is per GEMM, priced that way, at the efficiency
    target."""
    cfg = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    cfg["snip"].update(per_gemm=True, research={"dgrad_cost": "upstream", "dgrad_calibration": 30.0})
    path = tmp_path / "z3.json"
    path.write_text(json.dumps(cfg))
    code = """
import json, torch, snip_ds
from transformers import LlamaConfig, LlamaForCausalLM
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
engine = snip_ds.initialize(model, json.load(open(%r)), tokens_per_step=4 * 16)
ids = torch.randint(0, 64, (4, 16))
engine.train_step([{"input_ids": ids, "labels": ids}])
print(json.dumps({"meta": dict(engine.plan.meta), "per_gemm": engine.plan.per_gemm, "share": engine.plan_fp4_share()}))
""" % str(path)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["per_gemm"] and out["share"] >= cfg["snip"]["efficiency_saving"] - 1e-9  # FP64 share round-off
    assert out["meta"]["dgrad"] == "upstream" and out["meta"]["dgrad_calibration"] == 30.0


def test_a_nonfinite_output_on_one_rank_stops_every_rank_before_the_update(tmp_path):
    """snip.nonfinite "stop" (the default): rank 1's model.layers.1.mlp returns NaN in the second micro-batch of
    step 3; both ranks raise NonFiniteError with the same message naming the step, the micro-batch, the rank and
    the module, after steps 1-2 and before step 3's update."""
    ranks = _run("nonfinite_stop", tmp_path)
    for r in ranks:
        assert r["error"].startswith("non-finite loss (nan) at step 3, micro-batch 2 of 2 on rank 1; first module "
                                     "with a non-finite output: model.layers.1.mlp (LlamaMLP); the step's update "
                                     "was not applied"), r["error"]
    assert ranks[0]["error"] == ranks[1]["error"]


@pytest.mark.parametrize("case", ["nonfinite_skip", "nonfinite_skip_bf16", "nonfinite_skip_z0", "nonfinite_skip_z2"])
def test_a_nonfinite_step_is_skipped_on_every_rank_and_counted(tmp_path, case):
    """snip.nonfinite "skip" under ZeRO-3 in FP32 and with DeepSpeed's bf16 (FP32 master weights in the optimizer),
    and under ZeRO-0 and ZeRO-2 (each wraps the optimizer differently):
    step 3 changes no parameter on any rank (the float64 sum of every gathered parameter is the same before and
    after it, while every other step changes it), its learning rate stays for step 4 (as DeepSpeed's own overflow
    skip leaves it), the steps go on to 5 with finite losses, and TensorBoard counts the skip at step 3."""
    from train_utils import scalars

    ranks = _run(case, tmp_path)
    for r in ranks:
        assert "error" not in r and r["steps"] == [1, 2, 3, 4, 5] and r["skipped"] == 1
        sums = r["sums"]  # before step 1, after steps 1..5
        assert sums[3] == sums[2]  # step 3: exactly no update
        assert all(sums[i + 1] != sums[i] for i in (0, 1, 3, 4))
        losses = r["losses"]
        assert losses[2] != losses[2] and all(x == x for i, x in enumerate(losses) if i != 2)  # NaN only at 3
        # The next step's learning rate before step 1 and after steps 1..5 (WarmupLR gives its minimum to the
        # first two): step 3 leaves the warm-up where it was, every other step raises it.
        lrs = r["lrs"]
        assert lrs[3] == lrs[2] and all(lrs[i + 1] > lrs[i] for i in (1, 3, 4)), lrs
    assert ranks[0]["sums"] == ranks[1]["sums"] and ranks[0]["losses"][3:] == ranks[1]["losses"][3:]
    logged = scalars(tmp_path / f"{case}.tb")
    assert logged["train/skipped_steps"] == {3: 1.0}


_RANDOM_DATA_LOOP = """
import json, random, sys
import numpy as np, torch, snip_ds
from transformers import LlamaConfig, LlamaForCausalLM
cfg, save_dir, resume, steps = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3] or None, int(sys.argv[4])
random.seed(0)
np.random.seed(0)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
engine = snip_ds.initialize(model, cfg, tokens_per_step=4 * 16, resume_from=resume)
out = {}
while engine.step < steps:
    # the user's data code: token ids from NumPy, a crop from Python's random
    start = random.randrange(8)
    ids = torch.from_numpy(np.random.randint(0, 64, (4, 24)))[:, start:start + 16]
    loss = engine.train_step([{"input_ids": ids, "labels": ids}])
    out[engine.step] = loss
    if engine.step == 2 and not resume:
        engine.save_checkpoint(save_dir, {})
print(json.dumps(out))
"""


def test_a_resume_repeats_a_run_whose_data_code_draws_from_python_and_numpy_random(tmp_path):
    """``snip_ds.initialize`` in a loop whose batches come from Python's ``random`` and NumPy's global generator
    (seeded once at the start, as a user's script does): 4 steps in one go, saving at step 2, and steps 3-4 again
    from that checkpoint in a fresh process. The checkpoint carries both generators' states (and torch's), so the
    resumed steps see the same batches and give the same losses bit for bit; without them the fresh process
    would draw step 1's batches again."""
    cfg = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    cfg["snip"] = {"plan": "fp8"}
    path = tmp_path / "z3.json"
    path.write_text(json.dumps(cfg))

    def run(resume: str, steps: int) -> dict:
        proc = subprocess.run([sys.executable, "-c", _RANDOM_DATA_LOOP, str(path), str(tmp_path / "ckpt"), resume,
                               str(steps)], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}

    whole = run("", 4)
    resumed = run(str(tmp_path / "ckpt"), 4)
    assert sorted(whole) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    assert resumed == {3: whole[3], 4: whole[4]}
    assert len(set(whole.values())) == 4  # the batches differ from step to step
