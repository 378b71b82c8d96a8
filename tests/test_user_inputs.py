"""launch/train.py on a user's own inputs, end to end: a saved Hugging Face model directory, a text file and a
JSON-lines file as the dataset, a hand-written per-layer plan mixing bf16/fp8/fp4, and command-line flags that
override the JSON. Plus snip_ds.runtime.distributed's plan-digest check and JSON broadcast on two real gloo ranks.

Every expectation is computed here, independently of the trainer: the layer list from the saved model's
``named_modules``, the FP4 share from in_features x out_features, token counts from the bytes written, the
learning-rate schedule from DeepSpeed's documented WarmupCosineLR formula. The training runs are plain
one-rank ``python launch/train.py`` processes, started together so that they share the 2 cores.
"""
import json
import math
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from snip_ds.config.deepspeed_config import AUTO_DEFAULTS
from train_utils import REPO, TINY_MODEL, TRAIN, env, scalars, write_configs

pytestmark = [pytest.mark.slow]

BLOCK = 64
PRECISIONS = ("bf16", "fp8", "fp4")
# The user's model differs from TINY_MODEL (3 blocks, SwiGLU width 96): a plan naming its 21 layers is only
# accepted if this model, not the JSON's model_config, is the one trained.
USER_MODEL = {**{k: v for k, v in TINY_MODEL.items() if k != "model_type"}, "num_hidden_layers": 3,
              "intermediate_size": 96}
LM_HEAD_SCALE = 40.0  # the saved model's logits are 40x a fresh init's: its first loss is far above ln(vocab)
USER_STEPS = 3
# The flag-override runs: values that all differ from write_configs' JSON (seed 0, lr 0.002, micro batch 2, ga 1).
FLAG_STEPS, FLAG_LR, FLAG_MICRO, FLAG_GA, FLAG_SEED = 4, 5e-4, 1, 3, 5


def _words(n_bytes: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = ["alpha", "beta", "gamma", "delta", "präzision", "精度", "sum", "(x)", "=", "+", "\n", "layer", "0.5"]
    out, size = [], 0
    while size < n_bytes:
        w = rng.choice(vocab)
        out.append(w)
        size += len(w.encode()) + 1
    return " ".join(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _text_summaries(log_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return {tag: [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)] for tag in acc.Tags()["tensors"]}


def _run_config(out: Path) -> dict:
    """The resolved configuration the run logged to TensorBoard (``run/config``, a Markdown JSON block)."""
    text = _text_summaries(out / "tensorboard")["run/config/text_summary"][0]
    assert text.startswith("```json\n") and text.endswith("\n```")
    return json.loads(text[len("```json\n"):-len("\n```")])


def _ok(name: str, rc: int, out: str) -> str:
    assert rc == 0, f"{name}:\n{out[-6000:]}"
    assert "Traceback" not in out, f"{name}:\n{out[-6000:]}"
    return out


def _save_user_model(directory: Path, dataset_text: str) -> dict:
    """Saves a tiny LlamaForCausalLM (safetensors) and returns what the test knows about it, computed here."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    model = LlamaForCausalLM(LlamaConfig(**USER_MODEL))
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    model.save_pretrained(directory, safe_serialization=True)
    assert (directory / "model.safetensors").is_file() and (directory / "config.json").is_file()
    linears = {name: (m.in_features, m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.startswith("model.layers.")}
    # The saved model's own (unquantized) loss on the dataset's first blocks: what step 1 should be near.
    ids = torch.tensor(list(dataset_text.encode()[:4 * BLOCK]), dtype=torch.long).view(4, BLOCK)
    with torch.no_grad():
        loss = float(model(input_ids=ids, labels=ids).loss)
    return {"linears": linears, "saved_loss": loss}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Starts every training run of this module at once and waits for them: ``{name: (rc, output)}`` plus the
    inputs the tests compare against."""
    tmp = tmp_path_factory.mktemp("user_inputs")
    text = _words(6000, seed=0)
    (tmp / "corpus.txt").write_text(text, encoding="utf-8")
    records = [{"id": i, "text": _words(60 + 7 * (i % 5), seed=100 + i), "source": "x" * 50} for i in range(70)]
    (tmp / "corpus.jsonl").write_text("".join(json.dumps(r, ensure_ascii=(i % 2 == 0)) + "\n"
                                              for i, r in enumerate(records)), encoding="utf-8")

    # Flag overrides. "flags": the JSON says seed 0, lr 0.002, micro batch 2, ga 1; flags say otherwise.
    # "json": the same values written into the JSON, no flags. "noseed": the flags without --seed.
    (tmp / "flags").mkdir()
    flag_cfg = write_configs(tmp / "flags", plan="fp8", max_steps=FLAG_STEPS, eval_steps=FLAG_STEPS,
                             eval_batches=1, save_steps=0, dataset=str(tmp / "corpus.txt"))
    json_lr = json.loads(flag_cfg.read_text())["optimizer"]["params"]["lr"]
    if json_lr == "auto":  # the shipped configs leave it to the launcher: launch/train.py's documented default
        json_lr = AUTO_DEFAULTS["optimizer.params.lr"]
    data = json.loads(flag_cfg.read_text())
    data["optimizer"]["params"]["lr"] = FLAG_LR
    data.update(train_micro_batch_size_per_gpu=FLAG_MICRO, gradient_accumulation_steps=FLAG_GA)
    data["snip"]["train"].update(seed=FLAG_SEED, output_dir=str(tmp / "json"))
    (tmp / "flags" / "as_json.json").write_text(json.dumps(data))
    flags = ["--learning_rate", str(FLAG_LR), "--per_device_train_batch_size", str(FLAG_MICRO),
             "--gradient_accumulation_steps", str(FLAG_GA)]
    argv = {"flags": ["--deepspeed", str(flag_cfg), *flags, "--seed", str(FLAG_SEED), "--output_dir",
                      str(tmp / "flags_out")],
            "json": ["--deepspeed", str(tmp / "flags" / "as_json.json")],
            "noseed": ["--deepspeed", str(flag_cfg), *flags, "--output_dir", str(tmp / "noseed")]}
    procs = {}

    def start(name):
        procs[name] = subprocess.Popen([sys.executable, str(TRAIN), *argv[name], "--no_progress"], cwd=REPO,
                                       env=env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    for name in argv:
        start(name)

    # The user's model directory and plan, made while those runs start up.
    model_dir = tmp / "my_llama"
    user = _save_user_model(model_dir, text)
    fqns = sorted(user["linears"])
    rng = random.Random(7)
    plan = {fqn: PRECISIONS[i % 3] for i, fqn in enumerate(rng.sample(fqns, len(fqns)))}
    (tmp / "plan.json").write_text(json.dumps(plan))
    # The JSON names a different model (write_configs' model_config, TINY_MODEL): the flag must win.
    user_cfg = write_configs(tmp, plan="fp8", max_steps=USER_STEPS, eval_steps=USER_STEPS, eval_batches=1,
                             save_steps=0)
    for kind in ("txt", "jsonl"):
        argv[kind] = ["--deepspeed", str(user_cfg), "--model_name_or_path", str(model_dir), "--dataset",
                      str(tmp / f"corpus.{kind}"), "--plan", str(tmp / "plan.json"), "--output_dir",
                      str(tmp / f"user_{kind}")]
        start(kind)

    results = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        results[name] = (proc.returncode, out)
    return {"tmp": tmp, "results": results, "text": text, "records": records, "plan": plan, "user": user,
            "model_dir": model_dir, "flag_cfg": flag_cfg, "json_lr": json_lr}


@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_user_model_directory_dataset_and_mixed_plan(runs, kind):
    """--model_name_or_path DIR (a saved LlamaForCausalLM), --dataset (text or JSON-lines) and --plan with a
    bf16/fp8/fp4 mix: the plan's FP4 FLOP share is logged, the data read is exactly the file's, the saved
    weights are the ones trained, and the checkpoint records the plan file's assignment."""
    out_text = _ok(kind, *runs["results"][kind])
    tmp, plan, user = runs["tmp"], runs["plan"], runs["user"]
    out = tmp / f"user_{kind}"
    linears = user["linears"]
    assert len(linears) == 7 * USER_MODEL["num_hidden_layers"] and set(plan) == set(linears)
    assert set(plan.values()) == set(PRECISIONS)
    assert f"{len(linears)} quantizable linears" in out_text

    # FP4 share of linear FLOPs: every layer's three GEMMs cost 2*T*k*n each, so FLOPs are proportional to k*n.
    fp4 = sum(k * n for fqn, (k, n) in linears.items() if plan[fqn] == "fp4")
    expected_share = fp4 / sum(k * n for k, n in linears.values())
    assert 0.0 < expected_share < 1.0
    logged = scalars(out / "tensorboard")
    assert set(range(1, USER_STEPS + 1)) <= set(logged["plan/fp4_share"])  # (and step 0: the initial plan)
    for step, share in logged["plan/fp4_share"].items():
        assert share == pytest.approx(expected_share, rel=1e-6), step
    loss = logged["train/loss"]
    assert sorted(loss) == list(range(1, USER_STEPS + 1))
    assert all(math.isfinite(v) for v in loss.values()), loss
    # The weights came from DIR: step 1 (before any update) is near the saved model's loss (about 18, its
    # lm_head is scaled up), far from a fresh init's ln(vocab) = 5.6.
    fresh = math.log(USER_MODEL["vocab_size"])
    assert user["saved_loss"] > fresh + 6
    assert loss[1] > (user["saved_loss"] + fresh) / 2, (loss[1], user["saved_loss"])

    config = _run_config(out)
    assert config["snip"]["train"]["model_name_or_path"] == str(runs["model_dir"])
    assert config["snip"]["train"]["model_config"] is None
    assert config["snip"]["plan"] == str(tmp / "plan.json")
    # The data is exactly the file's: byte tokens plus one EOS per document (the JSON-lines "text" fields only).
    docs = [runs["text"]] if kind == "txt" else [r["text"] for r in runs["records"]]
    tokens = sum(len(d.encode("utf-8")) + 1 for d in docs)
    data = config["data"]
    assert data["documents"] == len(docs) and data["tokens"] == tokens
    assert data["train_blocks"] + data["validation_blocks"] == tokens // BLOCK and data["validation_blocks"] >= 1

    meta = json.loads((out / "checkpoints" / f"step_{USER_STEPS}" / "snip_meta.json").read_text())
    state = json.loads((out / "checkpoints" / f"step_{USER_STEPS}" / "snip_state.json").read_text())
    assert meta["step"] == state["step"] == USER_STEPS
    assert state["plan"]["assignment"] == plan
    assert state["plan"]["fp4_share"] == pytest.approx(expected_share, rel=1e-12)


def test_model_source_flag_replaces_the_jsons(tmp_path):
    """--model_name_or_path overrides a JSON's model_config (and --model_config a JSON's model_name_or_path);
    naming both on the command line is still refused. Regression: the flag used to be merged beside the JSON's
    other key, and every such run stopped with "give model_name_or_path or model_config, not both"."""
    from snip_ds.config.settings import ConfigError, load_ds_config, with_overrides

    _, settings = load_ds_config(write_configs(tmp_path))
    assert settings.train.model_config == str(tmp_path / "model.json")
    got = with_overrides(settings, model_name_or_path="my_llama", model_config=None).train
    assert (got.model_name_or_path, got.model_config) == ("my_llama", None)
    back = with_overrides(with_overrides(settings, model_name_or_path="my_llama"), model_config="other.json").train
    assert (back.model_name_or_path, back.model_config) == (None, "other.json")
    assert with_overrides(settings, seed=3).train.model_config == str(tmp_path / "model.json")  # untouched
    with pytest.raises(ConfigError, match="not both"):
        with_overrides(settings, model_name_or_path="my_llama", model_config="other.json")


def _warmup_cosine_lr(step: int, peak: float, max_steps: int, sched: dict) -> float:
    """The learning rate the optimizer holds after ``step`` optimizer steps (what train/lr logs at ``step``).

    DeepSpeed's WarmupCosineLR starts at iteration -1 (lr 0: the first step runs at lr 0) and advances once per
    optimizer step, so after ``step`` steps it is at iteration ``step - 1``. Warm-up is logarithmic over
    ``max(2, W)`` iterations, W = "auto" = max(1, max_steps // 10), then a cosine decay to ``cos_min_ratio``.
    """
    it = step - 1
    warmup = max(2, max(1, max_steps // 10))
    lo, cos_min = sched["warmup_min_ratio"], sched["cos_min_ratio"]
    if it < warmup:
        ratio = lo + (1 - lo) * math.log(it + 1) / math.log(warmup)
    else:
        progress = min(1.0, (it - warmup + 1) / max(1, max_steps - warmup))
        ratio = cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2
    return peak * ratio


def test_flags_override_the_json(runs):
    """--learning_rate, --per_device_train_batch_size, --gradient_accumulation_steps and --seed beat the JSON:
    the lr schedule peaks at the flag's value, each step processes micro x ga x block_size x world tokens, and
    the run equals, bit for bit, one whose JSON holds the same values; without --seed the first loss differs."""
    tmp = runs["tmp"]
    for name in ("flags", "json", "noseed"):
        _ok(name, *runs["results"][name])
    flags = scalars(tmp / "flags_out" / "tensorboard")
    as_json = scalars(tmp / "json" / "tensorboard")
    noseed = scalars(tmp / "noseed" / "tensorboard")
    steps = list(range(1, FLAG_STEPS + 1))
    assert sorted(flags["train/lr"]) == steps

    # Learning rate: the shipped scheduler (WarmupCosineLR, "auto" warm-up) scaled to the flag's lr, not the JSON's.
    scheduler = json.loads(runs["flag_cfg"].read_text())["scheduler"]
    assert scheduler["type"] == "WarmupCosineLR" and runs["json_lr"] != FLAG_LR
    sched = scheduler["params"]
    lr = flags["train/lr"]
    for step in steps:
        assert lr[step] == pytest.approx(_warmup_cosine_lr(step, FLAG_LR, FLAG_STEPS, sched), rel=1e-6, abs=1e-12)
    assert lr[1] == 0.0  # the first step runs at warm-up lr 0
    assert max(lr.values()) == pytest.approx(FLAG_LR, rel=1e-6) and max(lr.values()) <= FLAG_LR * (1 + 1e-6)
    assert max(lr.values()) < runs["json_lr"] / 2

    # Tokens per optimizer step: tokens_per_s = micro * ga * block_size * world / step_time_s.
    expected_tokens = FLAG_MICRO * FLAG_GA * BLOCK * 1
    json_tokens = 2 * 1 * BLOCK
    assert expected_tokens != json_tokens
    for step in steps:
        tokens = flags["perf/tokens_per_s"][step] * flags["perf/step_time_s"][step]
        assert tokens == pytest.approx(expected_tokens, rel=1e-5), step
    # ... and the data stream really consumed micro-batches of that size: ga per step, global batch micro x world.
    meta = json.loads((tmp / "flags_out" / "checkpoints" / f"step_{FLAG_STEPS}" / "snip_meta.json").read_text())
    assert meta["data"]["step"] == FLAG_STEPS * FLAG_GA and meta["data"]["global_batch_size"] == FLAG_MICRO
    assert meta["data"]["seed"] == FLAG_SEED and meta["settings"]["train"]["seed"] == FLAG_SEED

    # The flags act exactly as the same values in the JSON: identical losses and lr, bit for bit.
    assert as_json["train/loss"] == flags["train/loss"]
    assert as_json["train/lr"] == flags["train/lr"]
    assert all(math.isfinite(v) for v in flags["train/loss"].values())
    # --seed: seed 5 (flag) vs the JSON's seed 0 with everything else equal: another init and data order.
    assert noseed["train/loss"][1] != flags["train/loss"][1]
    assert noseed["train/lr"] == flags["train/lr"]  # lr does not depend on the seed


@pytest.mark.distributed
def test_plan_digest_agreement_and_json_broadcast_on_two_ranks(tmp_path):
    """Two gloo ranks (plain processes, env:// rendezvous) run tests/dist_scripts/agree_probe.py: ``agree`` is
    True on both ranks exactly when both pass the same text (or the same plan digest), False on both when one
    rank differs; ``broadcast_json`` delivers the sender's object, unchanged, to every rank."""
    script = REPO / "tests" / "dist_scripts" / "agree_probe.py"
    port = str(_free_port())
    procs = []
    for rank in range(2):
        e = env()
        e.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, str(script), "--out", str(tmp_path)], cwd=REPO, env=e,
                                      text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=120)[0])
    finally:
        for proc in procs:  # only a failed rank's partner is still running here
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-4000:]
    sys.path.insert(0, str(script.parent))
    try:
        import agree_probe
    finally:
        sys.path.remove(str(script.parent))
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, got in enumerate(res):
        assert got["rank"] == r and got["world"] == 2
        assert got["same_text"] is True and got["same_plan"] is True and got["same_plan_rebuilt"] is True
        assert got["different_text"] is False
        assert got["one_layer_differs"] is False and got["differs_on_rank0_only"] is False
        # broadcast_json: the sender's object on every rank, whatever the others passed in.
        assert got["bcast_from_0"] == agree_probe.RANK0_OBJECT
        assert got["bcast_from_1"] == {"sender": 1, "ok": [1, 2, 3]}
        assert got["bcast_empty"] == {}
        assert got["agree_after_broadcast"] is True
    # src is a rank within the group: in the group of global rank 1 alone, src=0 is global rank 1. (Regression:
    # it was passed to dist.broadcast as a global rank, and rank 1 got "Global rank 0 is not part of group".)
    assert res[1]["bcast_subgroup"] == {"within": "group"} and res[1]["agree_subgroup"] is True
    assert res[0]["received_plan_digest"] == res[1]["received_plan_digest"]
    # The received plan is rank 0's (one fp4 layer), not rank 1's placeholder.
    assert sum(v == "fp4" for v in res[1]["bcast_plan"]["assignment"].values()) == 1
