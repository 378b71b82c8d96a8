"""Tests for snip_ds.types: the block index of layer names and the per-GEMM precision triple."""
import pytest

from snip_ds.types import (GEMM_OPERAND_AXES, GEMM_OPERANDS, GEMMS, OPERANDS, GemmPrecision, block_index,
                           expert_pair, layer_kind)


@pytest.mark.parametrize("fqn, block, kind", [
    ("model.layers.3.mlp.down_proj", 3, "mlp.down_proj"),
    ("module.model.layers.12.self_attn.q_proj", 12, "self_attn.q_proj"),  # a DeepSpeed / DDP wrapper in front
    ("module.0.model.layers.5.mlp.up_proj", 5, "mlp.up_proj"),  # a container's number in front is no block
    ("layers.7.self_attn.o_proj", 7, "self_attn.o_proj"),
    ("model.layers.30", 30, "model.layers.30"),  # the block's own module name
    ("transformer.h.17.mlp.c_fc", 17, "mlp.c_fc"),  # GPT-2's block list is transformer.h
    ("model.decoder.layers.2.fc1", 2, "fc1"),  # OPT's
    ("model.mylayers.3.q_proj", 3, "q_proj"),  # whatever the list is called
    ("model.layers.3.mlp.experts.17.down_proj", 3, "mlp.experts.17.down_proj"),  # the first number is the block
])
def test_block_index_reads_the_block_lists_entry(fqn, block, kind):
    assert block_index(fqn) == block
    assert layer_kind(fqn) == kind


@pytest.mark.parametrize("fqn", ["lm_head", "model.embed_tokens", "model.layers.x.q_proj", "module.0.lm_head"])
def test_block_index_rejects_names_without_a_decoder_block(fqn):
    with pytest.raises(ValueError, match="no decoder block index"):
        block_index(fqn)
    assert layer_kind(fqn) == fqn


@pytest.mark.parametrize("fqn, pair", [
    ("model.layers.3.mlp.experts.17.down_proj", ("model.layers.3.mlp.experts", 17, "down_proj")),
    ("transformer.h.0.moe.experts.2.w1", ("transformer.h.0.moe.experts", 2, "w1")),  # a list of expert MLPs
    ("model.layers.3.mlp.down_proj", None),
    ("model.layers.3", None),
    ("lm_head", None),
])
def test_expert_pair_is_a_numbered_entry_inside_a_block(fqn, pair):
    assert expert_pair(fqn) == pair


def test_gemm_operands_cover_each_operand_twice():
    assert set(GEMM_OPERANDS) == set(GEMM_OPERAND_AXES) == set(GEMMS)
    uses = [o for g in GEMMS for o in GEMM_OPERANDS[g]]
    assert sorted(uses) == sorted(OPERANDS * 2)  # x, w and g each feed exactly two of the three GEMMs


def test_gemm_precision_of():
    assert GemmPrecision.of("fp8") == GemmPrecision("fp8", "fp8", "fp8")
    mixed = GemmPrecision.of({"fprop": "fp4", "dgrad": "fp8", "wgrad": "bf16"})
    assert mixed.uniform is None and mixed.to_json() == {"fprop": "fp4", "dgrad": "fp8", "wgrad": "bf16"}
    assert mixed.fp4_fraction() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="missing"):
        GemmPrecision.of({"fprop": "fp4"})
    with pytest.raises(ValueError, match="layer.fprop: unknown precision"):
        GemmPrecision.of({"fprop": "fp2", "dgrad": "fp8", "wgrad": "fp8"}, field="layer")
