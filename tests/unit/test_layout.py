"""Layout validation happens before any process group exists, and names the numbers."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mtcore.parallel.layout import Axis, LayoutError, LayoutSpec, ParallelLayout, _all_groups


def groups(spec: LayoutSpec, world: int) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    for name, members in _all_groups(spec.resolve(world)):
        out.setdefault(name, []).append(members)
    return out


def test_rank_order_is_tp_fastest_then_cp_dp_pp():
    g = groups(LayoutSpec(tp=2, pp=2), 8)
    assert sorted(g["tp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sorted(g["dp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sorted(g["pp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert sorted(g["mp"]) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_embedding_group_joins_first_and_last_stage_of_each_pipeline():
    g = groups(LayoutSpec(tp=2, pp=4), 8)
    assert sorted(g["embed"]) == [[0, 6], [1, 7]]
    assert "embed" not in groups(LayoutSpec(tp=2), 4)


def test_every_rank_is_in_exactly_one_group_of_each_kind():
    spec = LayoutSpec(tp=2, cp=2, pp=2, ep=2)
    for name, members in groups(spec, 16).items():
        if name == "embed":
            continue
        flat = sorted(r for m in members for r in m)
        assert flat == list(range(16)), name


def test_expert_groups_split_the_data_parallel_block():
    g = groups(LayoutSpec(ep=2), 4)
    assert sorted(g["ep"]) == [[0, 1], [2, 3]]
    assert sorted(g["edp"]) == [[0, 2], [1, 3]]


@pytest.mark.parametrize(
    ("spec", "world", "message"),
    [
        (dict(tp=3), 8, "world size 8 is not divisible by tp\\*cp\\*pp = 3\\*1\\*1 = 3"),
        (dict(tp=2, dp=3), 8, "tp\\*cp\\*dp\\*pp = 2\\*1\\*3\\*1 = 6 but the world has 8 ranks"),
        (dict(ep=3), 4, "ep=3 must divide dp\\*cp = 4\\*1 = 4"),
    ],
)
def test_impossible_layouts_name_the_numbers(spec, world, message):
    with pytest.raises(LayoutError, match=message):
        LayoutSpec(**spec).resolve(world)


def test_model_checks_name_the_numbers():
    spec = LayoutSpec(tp=4, sequence_parallel=True)
    with pytest.raises(LayoutError, match="6 attention heads are not divisible by tp=4"):
        spec.check_model(num_heads=6)
    with pytest.raises(LayoutError, match="sequence length"):
        spec.check_model(num_heads=8, seq_len=30)
    spec.check_model(num_heads=8, num_kv_heads=4, seq_len=32)


def test_bad_fields_rejected_by_the_config_model():
    with pytest.raises(ValidationError, match="sequence_parallel needs tp > 1"):
        LayoutSpec(sequence_parallel=True)
    with pytest.raises(ValidationError):
        LayoutSpec(tp=0)
    with pytest.raises(ValidationError):
        LayoutSpec(tq=2)


def test_single_process_layout():
    layout = ParallelLayout.single()
    assert (layout.tp, layout.dp, layout.pp, layout.tp_rank) == (1, 1, 1, 0)
    assert layout.is_first_stage and layout.is_last_stage
    assert layout.group(Axis.TP) is None
