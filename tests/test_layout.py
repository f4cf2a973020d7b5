"""The pure parts of the runtime: flat layout, strategy parsing, mixed precision, unit planning."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hybridshard.runtime.units.layout import FlatLayout
from hybridshard.runtime.units.strategy import MixedPrecision, ShardingStrategy
from hybridshard.runtime.units.wrap import choose_units
from tests.runtime_models import Block, TinyLM


def test_offsets_alignment_and_padding():
    layout = FlatLayout.build([("a", (3,)), ("b", (2, 2)), ("c", (5,))], shard_size=4, shard_rank=0, align_numel=4)
    assert [(s.name, s.offset, s.numel) for s in layout.slots] == [("a", 0, 3), ("b", 4, 4), ("c", 8, 5)]
    assert layout.numel == 12 and layout.padded_numel == 16 and layout.padding_numel == 4
    assert layout.shard_numel == 4


def test_local_slices_cover_every_element_once():
    params = [("w", (7, 3)), ("b", (7,)), ("tiny", (1,)), ("v", (11,))]
    for shard_size in (1, 2, 3, 4, 8, 64):
        seen = {n: [] for n, _ in params}
        for rank in range(shard_size):
            layout = FlatLayout.build(params, shard_size=shard_size, shard_rank=rank, align_numel=2)
            start, _ = layout.shard_range()
            for slot, part in zip(layout.slots, layout.local_slices()):
                assert 0 <= part.shard_offset and part.shard_offset + part.numel <= layout.shard_numel
                if part.numel:
                    assert slot.offset + part.param_start == start + part.shard_offset
                seen[slot.name] += range(part.param_start, part.param_start + part.numel)
        for name, shape in params:
            assert sorted(seen[name]) == list(range(torch.Size(shape).numel())), (shard_size, name)


def test_small_param_misses_some_shards():
    layouts = [FlatLayout.build([("t", (2,))], shard_size=4, shard_rank=r) for r in range(4)]
    assert [lay.local_slices()[0].numel for lay in layouts] == [1, 1, 0, 0]


def test_layout_round_trip_and_aliases():
    layout = FlatLayout.build([("e", (4, 2))], shard_size=2, shard_rank=1, aliases=[("head", "e")])
    assert FlatLayout.from_dict(layout.to_dict()) == layout
    assert layout.slot("head") is layout.slot("e")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(params=[("a", (2,)), ("a", (3,))], shard_size=2, shard_rank=0), "distinct"),
        (dict(params=[("a", (2,))], shard_size=2, shard_rank=2), "shard_rank"),
        (dict(params=[("a", (2,))], shard_size=0, shard_rank=0), "shard_size"),
        (dict(params=[("a", (2,))], shard_size=1, shard_rank=0, align_numel=0), "align_numel"),
        (dict(params=[("a", (2,))], shard_size=1, shard_rank=0, aliases=[("b", "zz")]), "alias"),
        (dict(params=[("a", (2,))], shard_size=2, shard_rank=0, shard_multiple=0), "shard_multiple"),
    ],
)
def test_layout_rejects_bad_input(kwargs, match):
    params = kwargs.pop("params")
    with pytest.raises(ValueError, match=match):
        FlatLayout.build(params, **kwargs)


def test_shard_multiple_pads_each_shard_into_equal_slices():
    """The optimizer's slices across replicas: each shard divides by ``shard_multiple``; 1 changes nothing."""
    params = [("a", (5, 3)), ("b", (7,))]
    plain = FlatLayout.build(params, shard_size=2, shard_rank=1)
    assert FlatLayout.build(params, shard_size=2, shard_rank=1, shard_multiple=1) == plain
    sliced = FlatLayout.build(params, shard_size=2, shard_rank=1, shard_multiple=3)
    assert (plain.padded_numel, sliced.padded_numel, sliced.shard_numel) == (22, 24, 12)
    assert sliced.slots == plain.slots


def test_strategy_parse():
    assert [s.name for s in ShardingStrategy] == [
        "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2",
    ]
    assert ShardingStrategy["HYBRID_SHARD"] is ShardingStrategy.parse("hybrid_shard")
    assert ShardingStrategy.parse("Shard_Grad_Op") is ShardingStrategy.SHARD_GRAD_OP
    with pytest.raises(ValueError, match="HYBRID_SHARD_ZERO2"):
        ShardingStrategy.parse("zero3")
    assert ShardingStrategy.HYBRID_SHARD_ZERO2.is_hybrid and not ShardingStrategy.HYBRID_SHARD_ZERO2.reshard_after_forward


def test_mixed_precision_validates_dtypes():
    MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with pytest.raises(ValueError, match="param_dtype"):
        MixedPrecision(param_dtype=torch.int8)


def test_choose_units_owns_tied_and_frozen_params():
    torch.manual_seed(0)
    model = TinyLM()
    specs = choose_units(model, {Block})
    assert [s.name for s in specs] == ["", "blocks.0", "blocks.1"]
    root = specs[0]
    assert "embed.weight" in root.param_names and "head.weight" not in root.param_names and ("head.weight", "embed.weight") in root.aliases
    assert "blocks.0.gate" in specs[1].param_names and not specs[1].params[specs[1].param_names.index("blocks.0.gate")].requires_grad
    names = [n for s in specs for n in s.param_names]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


def test_choose_units_errors():
    model = TinyLM()
    with pytest.raises(ValueError, match="matched no submodule"):
        choose_units(model, {nn.Conv2d})
    with pytest.raises(ValueError, match="nn.Module classes"):
        choose_units(model, {"Block"})
    assert len(choose_units(model, lambda m: isinstance(m, nn.LayerNorm))) == 4


class SubBlock(Block):
    pass


def test_choose_units_per_unit_strategies():
    model = TinyLM(num_blocks=3)
    model.blocks[2] = SubBlock()
    specs = choose_units(model, {Block: "no_shard"})
    assert [s.strategy for s in specs] == [None] + [ShardingStrategy.NO_SHARD] * 3
    # A module's own class wins over an earlier base-class entry; None means the model's strategy.
    specs = choose_units(model, {Block: None, SubBlock: ShardingStrategy.HYBRID_SHARD_ZERO2})
    assert [s.strategy for s in specs] == [None, None, None, ShardingStrategy.HYBRID_SHARD_ZERO2]
    chosen = {model.blocks[0]: True, model.blocks[1]: "Full_Shard"}
    specs = choose_units(model, lambda m: chosen.get(m))
    assert [(s.name, s.strategy) for s in specs] == [("", None), ("blocks.0", None), ("blocks.1", ShardingStrategy.FULL_SHARD)]
    assert "blocks.2.fc1.weight" in specs[0].param_names  # not a unit: the root owns it


@pytest.mark.parametrize(
    "wrap, match",
    [
        ({Block: "zero3"}, r"wrap\[Block\] must be a ShardingStrategy, one of FULL_SHARD, .*HYBRID_SHARD_ZERO2 .*got 'zero3'"),
        ({Block: True}, r"wrap\[Block\] must be a ShardingStrategy.*got True"),
        ({"Block": "NO_SHARD"}, "nn.Module classes"),
        (lambda m: "ddp" if isinstance(m, Block) else False, r"wrap policy result for 'blocks.0' \(Block\).*got 'ddp'"),
    ],
)
def test_choose_units_rejects_bad_strategies(wrap, match):
    with pytest.raises(ValueError, match=match):
        choose_units(TinyLM(), wrap)


def test_low_precision_grads_need_grad_dtype():
    from hybridshard.runtime.setup.api import _check_low_precision_grads

    mp = MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)
    _check_low_precision_grads(mp, torch.Tensor)  # torch has Tensor.grad_dtype
    _check_low_precision_grads(MixedPrecision(keep_low_precision_grads=True), object)  # nothing to keep

    class OldTensor:  # a torch without Tensor.grad_dtype
        pass

    with pytest.raises(ValueError, match="keep_low_precision_grads=True.*needs Tensor.grad_dtype"):
        _check_low_precision_grads(mp, OldTensor)
