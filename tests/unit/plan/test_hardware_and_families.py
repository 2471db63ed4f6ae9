"""Hardware files load and cite their sources; every built-in family is modelled."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtcore.plan import HardwareError, NotModelled, builtin_names, load_hardware, model_shape, plan
from mtcore.training.overrides import load_config

SHIPPED = {"A100-80GB", "H100-SXM", "H200", "B200", "MTT-S4000", "cpu-host"}


def test_the_shipped_descriptions():
    assert set(builtin_names()) == SHIPPED
    for name in SHIPPED:
        hw = load_hardware(name)
        assert hw.sources, f"{name} names no source for its numbers"
        assert hw.peak_flops("bf16") > 0 and hw.memory_bytes > 0
    assert load_hardware("a100-80gb").peak_tflops["bf16"] == 312.0


def test_a_user_file(tmp_path):
    path = tmp_path / "mine.toml"
    text = Path(load_hardware("H100-SXM").path).read_text()
    path.write_text(text.replace('"H100-SXM"', '"mine"'))
    assert load_hardware(str(path)).name == "mine"
    broken = tmp_path / "broken.toml"
    broken.write_text('name = "x"\nmemory_gb = 8\n')
    with pytest.raises(HardwareError, match=r"broken\.toml lacks"):
        load_hardware(str(broken))
    with pytest.raises(HardwareError, match="not found"):
        load_hardware(str(tmp_path / "absent.toml"))


def test_link_bandwidth_inside_and_across_nodes():
    hw = load_hardware("A100-80GB")
    assert hw.link(8, 1)[0] == 300e9  # one node: NVLink
    assert hw.link(32, 1)[0] == 200e9  # 8 members per node drive 8 ports
    assert hw.link(32, 8)[0] == 25e9  # one member per node: one port


@pytest.mark.parametrize(
    "path", ["configs/default.yaml", "configs/moe.yaml", "configs/bert.yaml", "configs/t5.yaml"]
)
def test_family_shapes_count_the_seams_parameters(path):
    config = load_config(path)
    from mtcore.plan.planner import with_data_vocab

    config = with_data_vocab(config)
    shape = model_shape(config.model)
    counted = sum(b.weights() for b in shape.blocks) + shape.embed_params + shape.head_params
    assert counted == pytest.approx(config.model.num_params(), rel=0.03)
    result = plan(config, 4, load_hardware("H100-SXM"))
    assert result.time.total > 0 and result.peak_memory > 0


def test_moe_experts_are_sharded_over_ep():
    config = load_config("configs/moe.yaml")
    result = plan(config, 4, load_hardware("H100-SXM"))
    assert result.layout["ep"] == 2
    assert result.ranks[0].expert_params > 0
    assert any("MoE" in note for note in result.notes)


def test_an_unknown_family_is_not_modelled():
    class Other:
        family = "mamba"

    with pytest.raises(NotModelled, match="does not model the 'mamba' family"):
        model_shape(Other())
