"""Tests for snip_ds.types: the block index of layer names and the per-GEMM precision triple."""
import pytest

from snip_ds.types import GEMM_OPERAND_AXES, GEMM_OPERANDS, GEMMS, OPERANDS, GemmPrecision, block_index


@pytest.mark.parametrize("fqn, block", [
    ("model.layers.3.mlp.down_proj", 3),
    ("module.model.layers.12.self_attn.q_proj", 12),   # a DeepSpeed / DDP wrapper in front
    ("module.0.model.layers.5.mlp.up_proj", 5),        # a digit before 'layers.<i>' is not the block
    ("layers.7.self_attn.o_proj", 7),
    ("model.layers.30", 30),                           # the block's own module name
])
def test_block_index_reads_the_layers_component(fqn, block):
    assert block_index(fqn) == block


@pytest.mark.parametrize("fqn", ["lm_head", "model.embed_tokens", "model.layers.x.q_proj", "transformer.h.17.mlp.c_fc",
                                 "model.mylayers.3.q_proj"])
def test_block_index_rejects_names_without_a_decoder_block(fqn):
    with pytest.raises(ValueError, match="no decoder block index"):
        block_index(fqn)


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
