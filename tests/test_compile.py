"""``torch.compile`` of SnipLinear: one graph per forward and per backward, through the custom ops of
snip_ds/backend/custom_ops.py, equal to eager bit for bit, for every backend that runs on a CPU.

The backends: ``emulated``; ``torch`` with the fused C++ kernels (snip_ds/backend/cpu, what ``auto`` runs on a
CPU); ``torch`` quantizing with plain torch ops (where the kernels did not build); ``auto`` with a per-GEMM plan
whose GEMMs run on different backends. (The Triton kernels' path, under the interpreter:
tests/test_compile_kernels.py.) Compiled and eager run the very same functions (snip_ds/backend/layer_step.py)
inside opaque operators, and the compiled graphs hold nothing but those operators and views, so no tolerance is
needed: every result is compared bit for bit, also through inductor, whose generated code around the ops
(reshapes, a ReLU) is exact.

Stochastic rounding under compile: a layer's backward draws from its own generator inside one operator, so
the draws are eager's for the same generator state (the same bits), a restored state repeats them, successive
steps draw afresh (no seed frozen into the graph), and the mean over many compiled steps is the exact
expectation within 6 standard errors.
"""
import copy
import math

import pytest
import torch
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd

from snip_ds.backend import cpu as cpu_kernels
from snip_ds.backend import custom_ops, statistics_backend
from snip_ds.linear import SnipLinear
from snip_ds.quant_config import QuantConfig
from snip_ds.types import GemmPrecision

CASES = {
    "fp8_hybrid": ("fp8", {}),
    "mxfp8": ("fp8", {"fp8_recipe": "mxfp8"}),
    "nvfp4_sr": ("fp4", {}),  # 2-D weight blocks, stochastic rounding: the default fp4 recipe
    "nvfp4_1d": ("fp4", {"weight_2d": False, "stochastic_rounding": False}),
    "mxfp4_hadamard_sr": ("fp4", {"fp4_recipe": "mxfp4", "hadamard": True}),
    "per_gemm": ({"fprop": "fp8", "dgrad": "fp4", "wgrad": "bf16"}, {}),
}
BACKENDS = ["emulated", "torch_cpu_kernels", "torch_plain", "auto"]
K, N = 72, 40  # not multiples of the MX / NVFP4 blocks: partial blocks along both
X_SHAPE = (3, 20, K)  # T = 60 tokens


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own layers: dynamo's caches (and its recompilation count per code object, which
    every SnipLinear instance's forward shares) start empty."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def backend(request, monkeypatch):
    name = request.param
    if name == "torch_cpu_kernels" and not cpu_kernels.available():
        pytest.skip(f"the CPU kernels did not build: {cpu_kernels.unavailable_reason()}")
    if name == "torch_plain":
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    return {"torch_cpu_kernels": "torch", "torch_plain": "torch"}.get(name, name)


class Graphs:
    """An aot_autograd backend that keeps the forward and backward graphs it is given."""

    def __init__(self):
        self.forward, self.backward = [], []
        self.backend = aot_autograd(fw_compiler=self._keep(self.forward), bw_compiler=self._keep(self.backward))

    @staticmethod
    def _keep(graphs):
        def compiler(gm, example_inputs):
            graphs.append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    @staticmethod
    def computing(graphs):
        """The graphs' operators other than views, detaches and tuple indexing."""
        return [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"
                and not str(n.target).startswith(_NOT_COMPUTING)]


_NOT_COMPUTING = ("<built-in function getitem>", "aten.view.", "aten.reshape.", "aten._unsafe_view.", "aten.t.",
                  "aten.detach.", "aten.alias.")


def _layer(precision, cfg_fields, backend_name, dtype=torch.float32, bias=True, seed=0):
    torch.manual_seed(seed)
    layer = SnipLinear(K, N, bias=bias, dtype=dtype, precision=precision,
                       quant_config=QuantConfig(backend=backend_name, **cfg_fields))
    with torch.no_grad():
        layer.weight.mul_(4.0)
    return layer


def _step(fn, layer, x, g, gen_seed=7):
    """One forward and backward; the layer's generator seeded first. Returns everything it computed and the
    generator's state after (how many draws were made)."""
    layer.generator = torch.Generator().manual_seed(gen_seed)
    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    y = fn(xi)
    y.backward(g)
    out = [y.detach(), xi.grad, layer.weight.grad]
    if layer.bias is not None:
        out.append(layer.bias.grad)
    return out, layer.generator.get_state()


def _assert_same(a, b):
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and u.shape == v.shape
        assert torch.equal(u, v), (u - v).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_compiled_layer_is_one_graph_of_custom_ops_equal_to_eager(backend, case, dtype):
    precision, fields = CASES[case]
    layer = _layer(precision, fields, backend, dtype)
    x = (torch.randn(X_SHAPE) * torch.logspace(-2, 2, X_SHAPE[1]).view(1, -1, 1)).to(dtype)
    g = (torch.randn(*X_SHAPE[:-1], N) * 1e-2).to(dtype)
    graphs = Graphs()
    eager, eager_state = _step(layer, layer, x, g)
    compiled, compiled_state = _step(torch.compile(layer, backend=graphs.backend, fullgraph=True), layer, x, g)
    _assert_same(eager, compiled)
    assert torch.equal(eager_state, compiled_state)  # the same draws, as many
    fw, bw = Graphs.computing(graphs.forward), Graphs.computing(graphs.backward)
    assert fw == ["snip_ds.quantized_linear.default"] and bw == ["snip_ds.quantized_linear_backward.default"]


@pytest.mark.parametrize("backend", ["torch_cpu_kernels"], indirect=True)
def test_explain_reports_no_graph_break_through_a_small_model(backend):
    model = nn.Sequential(_layer("fp8", {}, backend), nn.GELU(), SnipLinear(N, K, precision="fp4",
                                                                             quant_config=QuantConfig(backend=backend)))
    explained = torch._dynamo.explain(model)(torch.randn(4, 16, K))
    assert explained.graph_break_count == 0 and explained.graph_count == 1


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fp8_hybrid", "nvfp4_sr"])
@pytest.mark.parametrize("backend", ["torch_cpu_kernels"], indirect=True)
def test_inductor_compiles_a_model_of_snip_layers_bit_for_bit(backend, case):
    """Inductor's own code between the ops (a ReLU and its backward, reshapes) is exact, so the compiled
    model's output and gradients are eager's bit for bit."""
    precision, fields = CASES[case]
    first = _layer(precision, fields, backend)
    second = SnipLinear.from_linear(nn.Linear(N, K), precision, QuantConfig(backend=backend, **fields))
    model = nn.Sequential(first, nn.ReLU(), second)
    x, g = torch.randn(X_SHAPE), torch.randn(X_SHAPE) * 1e-2

    def step(fn):
        for i, layer in enumerate((first, second)):
            layer.generator = torch.Generator().manual_seed(10 + i)
        model.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        y.backward(g)
        return [y.detach(), xi.grad] + [p.grad for p in model.parameters()]

    _assert_same(step(model), step(torch.compile(model, backend="inductor", fullgraph=True)))


@pytest.mark.parametrize("backend", ["torch_cpu_kernels", "emulated"], indirect=True)
def test_stochastic_rounding_resumes_and_draws_afresh_under_compile(backend):
    layer = _layer("fp4", {"fp4_recipe": "mxfp4", "hadamard": True}, backend)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x, g = torch.randn(X_SHAPE), torch.randn(*X_SHAPE[:-1], N)
    layer.generator = torch.Generator().manual_seed(3)
    state = layer.generator.get_state()
    grads = []
    for _ in range(2):
        xi = x.clone().requires_grad_(True)
        compiled(xi).backward(g)
        grads.append(xi.grad)
    layer.generator.set_state(state)  # a resumed run: the restored state repeats the first step's draws
    xi = x.clone().requires_grad_(True)
    compiled(xi).backward(g)
    assert torch.equal(xi.grad, grads[0]) and not torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("backend", ["torch_cpu_kernels", "emulated"], indirect=True)
def test_stochastic_rounding_is_unbiased_under_compile(backend):
    """G_X = Q(G_Y) Q(W) over 200 compiled steps, G_Y rounded stochastically (NVFP4): the mean is the exact
    expectation E[Q(G_Y)] Q(W) (statistics_backend().dgrad_moments) within 6 standard errors plus the FP32
    GEMMs' round-off (both sum n exact products in FP32 in their own orders: 2 n 2**-24 of the sum of
    |terms|, which |Q(G_Y)| <= 1.07 amax(G_Y) bounds: an E4M3 block scale rounds up by at most 2**-4)."""
    cfg = QuantConfig(backend=backend)
    layer = _layer("fp4", {}, backend, bias=False)
    layer.generator = torch.Generator().manual_seed(5)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x, g = torch.randn(64, K), torch.randn(64, N) * torch.logspace(-1, 1, N)
    draws, total, first = 200, torch.zeros(64, K, dtype=torch.float64), None
    for _ in range(draws):
        xi = x.clone().requires_grad_(True)
        compiled(xi).backward(g)
        first = xi.grad if first is None else first
        total += xi.grad.double()
    assert not torch.equal(first, xi.grad)
    moments = statistics_backend().dgrad_moments(g, layer.weight.detach(), "fp4", cfg)
    w_q = statistics_backend().quantize_whole(layer.weight.detach(), "fp4", "w", 0, cfg)
    gemm = 2 * N * 2.0 ** -24 * 1.07 * g.abs().max().double() * w_q.abs().double().sum(0)
    err = (total / draws - moments.mean.double()).abs()
    assert (err <= 6 * (moments.var.double() / draws).sqrt() + 2 * gemm).all()


@pytest.mark.parametrize("backend", ["torch_cpu_kernels"], indirect=True)
def test_a_new_precision_recompiles_instead_of_running_the_old_graph(backend):
    layer = _layer("fp8", {}, backend)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x, g = torch.randn(X_SHAPE), torch.randn(*X_SHAPE[:-1], N)
    _step(compiled, layer, x, g)
    for precision in ("fp4", {"fprop": "fp4", "dgrad": "fp8", "wgrad": "fp8"}, "bf16"):
        layer.precision = precision
        _assert_same(_step(layer, layer, x, g)[0], _step(compiled, layer, x, g)[0])
    layer.precision = "fp8"
    layer.quant_config = QuantConfig(backend=backend, fp8_recipe="mxfp8")
    _assert_same(_step(layer, layer, x, g)[0], _step(compiled, layer, x, g)[0])


@pytest.mark.parametrize("backend", ["torch_cpu_kernels"], indirect=True)
def test_a_copied_layer_draws_from_its_own_generator(backend):
    layer = _layer("fp4", {}, backend)
    twin = copy.deepcopy(layer)
    assert twin.op_handle != layer.op_handle
    layer.generator, twin.generator = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    x, g = torch.randn(X_SHAPE), torch.randn(*X_SHAPE[:-1], N)
    torch.compile(twin, backend="aot_eager", fullgraph=True)(x.requires_grad_(True)).backward(g)
    assert torch.equal(layer.generator.get_state(), torch.Generator().manual_seed(1).get_state())
    assert not torch.equal(twin.generator.get_state(), torch.Generator().manual_seed(2).get_state())


def test_spec_round_trips_and_a_bad_spec_or_handle_is_named():
    for prec in (GemmPrecision.of("fp8"), GemmPrecision.of({"fprop": "fp4", "dgrad": "bf16", "wgrad": "fp8"})):
        cfg = QuantConfig(fp8_recipe="mxfp8", fp4_recipe="mxfp4", stochastic_rounding=False, hadamard=True,
                          weight_2d=False, backend="emulated")
        assert custom_ops.parse_spec(custom_ops.op_spec(prec, cfg)) == (prec, cfg)
        assert custom_ops.parse_spec(custom_ops.op_spec(prec, cfg, "float8_e4m3fn,amax")) == (prec, cfg)
    with pytest.raises(ValueError, match=r"^spec: 'fp8;x' is not a snip_ds quantized-linear spec"):
        custom_ops.parse_spec("fp8;x")
    with pytest.raises(ValueError, match=r"is not a snip_ds quantized-linear spec \(5 parts\)"):
        custom_ops.parse_spec(custom_ops.op_spec(GemmPrecision.of("fp8"), QuantConfig(), "x,w") + ";a;b")
    layer = SnipLinear(16, 16, precision="fp8")
    handle = layer.op_handle
    del layer
    with pytest.raises(RuntimeError, match=f"layer handle {handle} names no live SnipLinear"):
        custom_ops.quantized_linear(torch.randn(2, 16), torch.randn(16, 16), None,
                                    custom_ops.op_spec(GemmPrecision.of("fp8"), QuantConfig()), handle)


def test_the_compiled_graph_names_what_the_forward_keeps(monkeypatch):
    """The op's spec in a compiled graph ends in what the layer's forward keeps for backward (X itself and W on
    the CPU's own path), so that a graph traced where the backends keep X's quantized values and W's amax (the
    Triton kernels' devices) is another graph, which the compile caches -- they outlive the process -- never
    hand to a process whose backends keep X (a cached graph would otherwise pass the op's outputs to backward
    as what they are not)."""
    from snip_ds.backend import layer_step

    layer = SnipLinear(K, N, precision="fp8", quant_config=QuantConfig(backend="torch"))
    x = torch.randn(X_SHAPE)
    specs = []

    def record(gm, example_inputs):
        specs.extend(node.args[3] for node in gm.graph.nodes
                     if node.target is torch.ops.snip_ds.quantized_linear.default)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(layer, backend=record, fullgraph=True)(x)
    assert len(specs) == 1 and specs[0].endswith(";x,w"), specs
    assert custom_ops.parse_spec(specs[0]) == (layer.gemm_precision, layer.quant_config)
    monkeypatch.setattr(layer_step, "kept_x_dtype", lambda *a: torch.float8_e4m3fn)
    monkeypatch.setattr(layer_step, "keeps_w_amax", lambda *a: True)
    assert custom_ops.kept_operands(custom_ops.op_spec(layer.gemm_precision, layer.quant_config), x,
                                    layer.matrix) == "float8_e4m3fn,amax"
    torch._dynamo.reset()


@pytest.mark.parametrize("recipe", ["fp8_e4m3", "mxfp8", "nvfp4", "nvfp4_2d", "mxfp4"])
def test_the_cpu_kernels_trace_as_operators(recipe):
    """The fused C++ kernels' ops have shape functions: a compiled function calling them is one graph and
    computes what they compute eagerly (stochastic rounding from a seed tensor, read by the kernel)."""
    if not cpu_kernels.available():
        pytest.skip(f"the CPU kernels did not build: {cpu_kernels.unavailable_reason()}")

    def quantize(x, seed):
        amax = cpu_kernels.tensor_amax(x)
        p = cpu_kernels.quantize_parts(x, recipe, 0, tensor_amax=amax, stochastic=recipe != "fp8_e4m3", seed=seed)
        return p.values * p.tensor_scale

    x, seed = torch.randn(48, 40) * 3, torch.tensor(12345, dtype=torch.int64)
    compiled = torch.compile(quantize, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, seed), quantize(x, seed))
    assert not math.isnan(float(compiled(x, seed + 1).sum()))


_DS_RUN = """
import json, sys, torch, snip_ds
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
cfg = json.load(open(%r))
cfg["snip"].update(early_replan_steps=[2], replan_every=1000, additional_bf16_fwd_every_n_steps=2)
engine = snip_ds.initialize(model, cfg, tokens_per_step=4 * 16)
if sys.argv[1] == "compiled":
    engine.ds.compile(backend="aot_eager")
gen = torch.Generator().manual_seed(1)
losses = []
for _ in range(4):
    ids = torch.randint(0, 64, (4, 16), generator=gen)
    losses.append(engine.train_step([{"input_ids": ids, "labels": ids}]))
from torch._dynamo.utils import counters
print("RESULT " + json.dumps({"losses": losses, "plans": [h["step"] for h in engine.planner.history],
                              "breaks": sum(counters["graph_break"].values())}))
"""


@pytest.mark.slow
def test_deepspeed_engine_compile_trains_as_eager_without_graph_breaks(tmp_path):
    """``engine.ds.compile()`` (DeepSpeed's own compile: ``module.compile()``) on an adaptive ZeRO-1 run of a
    small Llama: no graph break, and the losses -- the first plan, a re-plan at step 2, the measured BF16
    forwards -- are eager's bit for bit: SNIP's collection and measuring forwards run eagerly inside the
    compiled model (snip_ds/runtime/compile_stance.py)."""
    import json
    import subprocess
    import sys

    from train_utils import REPO, env

    code = _DS_RUN % str(REPO / "ds_configs" / "zero1.json")
    runs = {}
    for mode in ("eager", "compiled"):
        proc = subprocess.run([sys.executable, "-c", code, mode], cwd=tmp_path, env=env(), capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert runs["compiled"]["breaks"] == 0
    assert runs["compiled"]["losses"] == runs["eager"]["losses"] and runs["compiled"]["plans"] == [0, 2]


_HF_RUN = """
import json, sys, torch
from transformers import Trainer, TrainingArguments, default_data_collator, TrainerCallback
from snip_ds.run.data import BlockDataset
from snip_ds.hf import SnipCallback
from snip_ds.run.model import build_model
TINY = {"model_type": "llama", "vocab_size": 257, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
compiled = sys.argv[1] == "compiled"
model = build_model(None, dict(TINY), vocab_size=257, seed=0, block_size=64)
args = TrainingArguments(output_dir="%s", per_device_train_batch_size=2, max_steps=4, learning_rate=1e-2,
                         logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True, seed=0,
                         torch_compile=compiled, torch_compile_backend="aot_eager" if compiled else None)
losses = []
class L(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs: losses.append(logs["loss"])
snip = SnipCallback(settings={"plan": "adaptive", "replan_every": 2, "additional_bf16_fwd_every_n_steps": 2})
trainer = Trainer(model=model, args=args, train_dataset=BlockDataset(torch.randint(0, 257, (16, 64), generator=torch.Generator().manual_seed(0))),
                  data_collator=default_data_collator, callbacks=[snip, L()])
snip.attach(trainer)
trainer.train()
from torch._dynamo.utils import counters
print("RESULT", json.dumps({"losses": losses, "breaks": sum(counters["graph_break"].values()), "frames": dict(counters["stats"])}))
"""


@pytest.mark.slow
def test_the_trainer_with_torch_compile_trains_as_eager_without_graph_breaks(tmp_path):
    """The Hugging Face Trainer's ``torch_compile`` (here with the aot_eager backend) and SnipCallback, an
    adaptive plan re-planned at step 2: no graph break and the logged losses of the eager run, bit for bit."""
    import json
    import subprocess
    import sys

    from train_utils import env

    runs = {}
    for mode in ("eager", "compiled"):
        proc = subprocess.run([sys.executable, "-c", _HF_RUN % str(tmp_path / mode), mode], cwd=tmp_path, env=env(),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert runs["compiled"]["breaks"] == 0 and runs["compiled"]["frames"]["unique_graphs"] >= 1
    assert len(runs["eager"]["losses"]) == 4 and runs["compiled"]["losses"] == runs["eager"]["losses"]
