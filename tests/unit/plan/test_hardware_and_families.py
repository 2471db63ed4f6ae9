"""Hardware files load and cite their sources; every built-in family is modelled, the
vision-language one checked against the real model it builds (frozen parts included)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Literal

import pytest

from mtcore.backend import hookimpl, plugin_registry
from mtcore.cli.main import main
from mtcore.models import ModelFamily, reset_plugin_families
from mtcore.models.gpt import GPTConfig
from mtcore.models.gpt.family import GPTFamily
from mtcore.plan import (
    HardwareError,
    NotModelled,
    builtin_names,
    load_hardware,
    model_shape,
    network,
    plan,
    timing,
)
from mtcore.plan.hardware import builtin_descriptions, find_description
from mtcore.plan.planner import with_data_vocab
from mtcore.plan.shapes import stage_params
from mtcore.training.overrides import load_config

SHIPPED = {"A100-80GB", "H100-SXM", "H200", "B200", "MTT-S4000", "cpu-host"}


def test_the_shipped_descriptions():
    assert set(builtin_names()) == SHIPPED
    for name in SHIPPED:
        hw = load_hardware(name)
        assert hw.sources, f"{name} names no source for its numbers"
        assert hw.peak_flops("bf16") > 0 and hw.memory_bytes > 0
    assert load_hardware("a100-80gb").peak_tflops["bf16"] == 312.0


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("h100", "H100-SXM"),
        ("H100 SXM", "H100-SXM"),
        ("h100_sxm5", "H100-SXM"),
        ("a100", "A100-80GB"),
        ("A100-SXM4-80GB", "A100-80GB"),
        ("h200", "H200"),
        ("b200", "B200"),
        ("s4000", "MTT-S4000"),
        ("CPU", "cpu-host"),
    ],
)
def test_shipped_descriptions_by_name_or_alias_in_any_case(query, name):
    assert load_hardware(query).name == name


def test_names_that_are_not_shipped_or_are_ambiguous_are_refused_in_one_line():
    # H20 is a different accelerator from H200; an A100 40GB is not the 80GB file.
    for query in ("h20", "a100-40gb", "h1"):
        with pytest.raises(
            HardwareError,
            match=rf"^no hardware description named '{query}'; shipped: A100-80GB \(A100, ",
        ) as err:
            load_hardware(query)
        assert "\n" not in str(err.value)
    shipped = builtin_descriptions()
    a100 = find_description("a100", shipped)
    forty = replace(
        a100, name="A100-40GB", memory_gb=40.0, aliases=("A100",), path="a100-40gb.toml"
    )
    assert find_description("a100-40gb", [*shipped, forty]) is forty
    with pytest.raises(HardwareError) as err:
        find_description("a100", [*shipped, forty])
    assert str(err.value) == (
        "hardware name 'a100' is ambiguous: it could be A100-80GB (A100, A100-SXM4-80GB), "
        "A100-40GB (A100); give one of those names"
    )


def test_shipped_names_and_aliases_name_one_description_each():
    def keys(hw) -> set[str]:
        names = {hw.name, Path(hw.path).stem, *hw.aliases}
        return {"".join(char for char in name.lower() if char.isalnum()) for name in names}

    every = [key for hw in builtin_descriptions() for key in keys(hw)]
    assert len(every) == len(set(every))


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
    assert network.ring_bandwidth(hw, 8, 1) == 300e9  # one node: NVLink
    assert network.ring_bandwidth(hw, 32, 1) == 200e9  # 8 members per node drive 8 ports
    assert network.ring_bandwidth(hw, 32, 8) == 25e9  # one member per node: one port


FAMILY_CONFIGS = [
    "configs/default.yaml",
    "configs/moe.yaml",
    "configs/bert.yaml",
    "configs/t5.yaml",
    "configs/llava.yaml",
]


@pytest.mark.parametrize("path", FAMILY_CONFIGS)
def test_family_shapes_count_the_seams_parameters(path):
    config = with_data_vocab(load_config(path))
    shape = model_shape(config.model)
    counted = sum(b.weights() for b in shape.blocks) + shape.embed_params + shape.head_params
    counted += shape.first_stage_params
    assert counted == pytest.approx(config.model.num_params(), rel=0.03)
    result = plan(config, 4, load_hardware("H100-SXM"))
    assert result.time.total > 0 and result.peak_memory > 0


def test_moe_experts_are_sharded_over_ep():
    config = load_config("configs/moe.yaml")
    result = plan(config, 4, load_hardware("H100-SXM"))
    assert result.layout["ep"] == 2
    assert result.ranks[0].expert_params > 0
    assert any("MoE" in note for note in result.notes)


class _PlannedConfig(GPTConfig):
    family: Literal["planned_gpt"] = "planned_gpt"


class _Planned(GPTFamily):
    """An out-of-tree family with a shape (a GPT under another name)."""

    name, config, description = "planned_gpt", _PlannedConfig, "a GPT from a plugin"


class _UnplannedConfig(GPTConfig):
    family: Literal["unplanned_gpt"] = "unplanned_gpt"


class _Unplanned(GPTFamily):
    """An out-of-tree family without a shape."""

    name, config, description = "unplanned_gpt", _UnplannedConfig, "a GPT without a shape"
    shape = ModelFamily.shape


class _FamilyPlugin:
    @hookimpl
    def mtcore_model_families(self):
        return [_Planned(), _Unplanned()]


@pytest.fixture
def plugin_families():
    """The two families above, contributed by a plugin registered in this process."""
    registry = plugin_registry()
    registry.register(_FamilyPlugin(), "plan_test_families")
    reset_plugin_families()
    yield
    registry.manager.unregister(name="plan_test_families")
    registry.discovery.plugins.pop("plan_test_families", None)
    reset_plugin_families()


def _plan_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", "configs/default.yaml", "--gpus", "4", "--json", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_an_out_of_tree_family_is_planned_from_its_shape(plugin_families, capsys):
    """plan/ names no family: a plugin's family with a shape plans as its shape says (here
    a GPT's, so the numbers are the built-in GPT's), one without is refused in one line."""
    code, gpt, _ = _plan_cli(capsys)
    assert code == 0
    code, planned, err = _plan_cli(capsys, "--model.family", "planned_gpt")
    assert code == 0, err
    want, got = json.loads(gpt), json.loads(planned)
    assert got.pop("family") == "planned_gpt" and want.pop("family") == "gpt"
    assert got == want
    code, out, err = _plan_cli(capsys, "--model.family", "unplanned_gpt")
    assert code == 2 and out == ""
    assert err.count("\n") == 1, err
    assert "does not model the 'unplanned_gpt' family" in err and "ModelFamily.shape" in err
    with pytest.raises(NotModelled, match="'unplanned_gpt'"):
        model_shape(_UnplannedConfig(vocab_size=256))


# -- the vision-language family (model.family: llava) -------------------------------------
LLAVA = "configs/llava.yaml"


def llava(*overrides: str):
    """configs/llava.yaml's model (vocabulary from data.vocab_size, as the planner reads it)."""
    return with_data_vocab(load_config(LLAVA, list(overrides))).model


def stage_blocks(shape, pp: int, rank: int):
    """``((block, how many), ...)`` of pipeline rank ``rank`` (vpp 1), as the planner groups them."""
    counts = shape.counts(pp, 1)
    start = sum(counts[:rank])
    groups: dict = {}
    for block in shape.blocks[start : start + counts[rank]]:
        groups[block] = groups.get(block, 0) + 1
    return tuple(groups.items())


def real_counts(module) -> tuple[int, int]:
    """(trained, frozen) parameters of a built module, as the trainer tells them apart."""
    params = list(module.parameters())
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    return sum(p.numel() for p in params) - frozen, frozen


@pytest.mark.parametrize("freeze", ["[]", "[vision]", "[vision, language]", "[projector]"])
def test_llava_stages_hold_what_the_real_model_holds(freeze):
    """Whole model and each chunk of a pp=2 split, built for real on the cpu backend:
    the shape's trained and frozen parameters within the blocks' biases and norms (the
    planner leaves those out for every family)."""
    from mtcore.backend import select_backend
    from mtcore.models import get_family
    from mtcore.models.common.layers import single_context
    from mtcore.models.vlm.model import Llava

    config = llava("--model.freeze", freeze)
    backend = select_backend("cpu")
    shape = model_shape(config)
    whole = real_counts(get_family("llava").one_process(config, backend))
    held = stage_params(shape, stage_blocks(shape, 1, 0), 1, 1, 1, True, True)
    assert sum(whole) == config.num_params()
    assert held.trained == pytest.approx(whole[0], rel=0.01, abs=1)
    assert held.frozen == pytest.approx(whole[1], rel=0.02, abs=1)

    context = single_context(config, backend)
    half = config.num_layers // 2
    for rank, layers in enumerate((range(0, half), range(half, config.num_layers))):
        first, last = rank == 0, rank == 1
        chunk = real_counts(Llava(config, context, layers=layers, first=first, last=last))
        held = stage_params(shape, stage_blocks(shape, 2, rank), 1, 1, 2, first, last)
        assert held.trained == pytest.approx(chunk[0], rel=0.01, abs=1), rank
        assert held.frozen == pytest.approx(chunk[1], rel=0.02, abs=1), rank


def test_llava_puts_the_tower_on_the_first_stage():
    config = llava()
    shape = model_shape(config)
    tower, lm = config.vision.num_layers, config.num_layers
    assert shape.counts(2, 1) == [tower + lm // 2, lm // 2]
    assert shape.counts(2, 2) == [tower + lm // 4] + [lm // 4] * 3
    first = shape.blocks[0]
    assert (first.hidden, first.heads, first.ffn) == (64, 4, 256)  # the ViT's own sizes
    assert (first.seq, first.kv_seq) == (17, 17)  # 16 patches and the class token
    assert shape.blocks[tower].seq == config.seq_len == 40  # the image's 16 tokens included
    # patches (3 x 8 x 8 -> 64), positions, class token and pre-norm, then the projector
    embedding = 3 * 8 * 8 * 64 + 17 * 64 + 64 + 2 * 64
    assert shape.first_stage_params == embedding + config.projector_params()


def test_llava_image_slots_are_sequences_of_the_tower():
    """Two image slots per sample: twice the tower's tokens, each attending to its own
    image's (attention grows linearly in the slots, not quadratically)."""
    one = model_shape(llava()).blocks[0]
    two = model_shape(llava("--model.images.max_images", "2")).blocks[0]
    assert (two.seq, two.kv_seq) == (2 * one.seq, one.kv_seq)
    assert two.attention_product_flops() == 2 * one.attention_product_flops()


@pytest.mark.parametrize("overrides", [(), ("--model.images.max_images", "2")])
def test_llava_flops_are_the_familys(overrides):
    """Three passes of the blocks and the head, with the patch embedding's and the
    projector's products (``first_stage_flops``), give the family's ``flops_per_step``
    exactly: the tower's blocks against ``flops_per_image``, the language model's and
    head against the GPT's count."""
    from mtcore.models.gpt import GPTConfig

    config = llava(*overrides)
    shape, v, images = model_shape(config), config.vision, config.images.max_images
    tower, language = shape.blocks[: v.num_layers], shape.blocks[v.num_layers :]
    patch = v.seq_len * 6.0 * v.channels * v.patch_size**2 * v.hidden_size
    projector = 6.0 * v.num_features * config.projector_params()
    head = 2.0 * shape.head_seq * shape.vocab * shape.hidden
    assert 3 * sum(b.forward_flops() for b in tower) == images * (v.flops_per_image() - patch)
    assert 3 * (sum(b.forward_flops() for b in language) + head) == pytest.approx(
        GPTConfig.flops_per_step(config, 8) / 8
    )
    blocks = 3 * (sum(b.forward_flops() for b in shape.blocks) + head)
    assert shape.first_stage_flops == pytest.approx(images * (patch + projector))
    assert blocks + shape.first_stage_flops == pytest.approx(config.flops_per_step(8) / 8)


@pytest.mark.parametrize(
    "freeze", ["[vision]", "[vision, language]", "[projector]", "[language]", "[vision, projector]"]
)
def test_llava_model_flops_count_what_frozen_parts_compute(freeze):
    """The family's ``flops_per_step`` and the planner's blocks agree part by part when
    parts are frozen: weight products run ``Block.passes`` times (3 trained, 2 frozen
    passing the gradient on, 1 under no_grad), score products 3 times whenever there is a
    backward, the head twice when the language model is frozen. The patch embedding and
    projector (not blocks) follow the same rule. Freezing only ever lowers the count."""
    config = llava("--model.freeze", freeze)
    shape, v, images = model_shape(config), config.vision, config.images.max_images
    weights = sum(b.passes * 2.0 * b.seq * b.active_weights() for b in shape.blocks)
    scores = sum(b.product_passes * b.attention_product_flops() for b in shape.blocks)
    head = (2 if shape.embed_frozen else 3) * 2.0 * shape.head_seq * shape.vocab * shape.hidden
    patch = images * v.seq_len * 2.0 * v.channels * v.patch_size**2 * v.hidden_size
    patch *= 1 if config.frozen("vision") else 3
    projector = images * 2.0 * v.num_features * config.projector_params()
    if config.frozen("projector"):
        projector *= 2 if not config.frozen("vision") else 1
    else:
        projector *= 3
    assert shape.first_stage_flops == pytest.approx(patch + projector, rel=1e-9)
    want = weights + scores + head + patch + projector
    assert config.flops_per_step(8) / 8 == pytest.approx(want, rel=1e-9)
    assert config.flops_per_step(8) < llava().flops_per_step(8)


def test_the_first_stage_pays_for_the_patch_embedding_and_projector(monkeypatch):
    """One stage (pp = 1) on H100: the step's compute is longer by exactly those products'
    FLOPs over the matmul rate the planner credits, once per sequence of the step."""
    from dataclasses import replace as replaced

    from mtcore.plan import planner

    config = load_config(LLAVA, ["--parallel.tp", "1", "--parallel.pp", "1"])
    hardware = load_hardware("H100-SXM")
    with_them = plan(config, 1, hardware)
    shape = model_shape(with_data_vocab(config).model)
    monkeypatch.setattr(
        planner, "model_shape", lambda model: replaced(shape, first_stage_flops=0.0)
    )
    without = plan(config, 1, hardware)
    rate = timing.gemm_flops(hardware, hardware.peak_flops(config.precision.dtype))
    sequences = config.training.global_batch_size
    extra = with_them.time.compute - without.time.compute
    assert shape.first_stage_flops > 0
    assert extra == pytest.approx(sequences * shape.first_stage_flops / rate, rel=1e-9)


def test_llava_frozen_parts_run_as_the_trainer_runs_them():
    """A frozen tower runs under no_grad (no backward, no activations); a frozen language
    model in front of a trained projector still passes the gradient back (LLaVA stage 1)."""
    stage2 = model_shape(llava("--model.freeze", "[vision]"))
    stage1 = model_shape(llava("--model.freeze", "[vision, language]"))
    tower = llava().vision.num_layers
    assert {b.backward for b in stage2.blocks[:tower]} == {"none"}
    assert {b.backward for b in stage2.blocks[tower:]} == {"full"}
    assert {b.backward for b in stage1.blocks[tower:]} == {"input"}
    assert stage1.embed_frozen and not stage2.embed_frozen
    assert not stage2.blocks[0].keeps_activations and stage2.blocks[0].passes == 1
    assert stage1.blocks[tower].keeps_activations and stage1.blocks[tower].passes == 2
    # what the projector alone trains: its weights, on the first stage only
    held = stage_params(stage1, stage_blocks(stage1, 2, 1), 1, 1, 2, False, True)
    assert held.trained == 0 and held.frozen > 0


def test_llava_plans_with_tp_and_pp():
    config = load_config(LLAVA)
    result = plan(config, 4, load_hardware("H100-SXM"))
    assert result.family == "llava" and result.layout["tp"] == 2 and result.layout["pp"] == 2
    assert result.params == with_data_vocab(config).model.num_params()
    assert result.ranks[0].params > result.ranks[1].params  # the tower is on stage 0
    under_cp = plan(
        load_config(LLAVA, ["--parallel.cp", "2", "--parallel.pp", "1"]),
        4,
        load_hardware("H100-SXM"),
    )
    assert under_cp.layout["cp"] == 2


def test_cp_splits_the_language_model_but_not_the_vision_tower():
    """The tower runs whole on every cp rank (its images are not split); the language
    model's blocks keep half their activations at cp2."""
    from mtcore.plan.memory import layer_activation_bytes

    shape = model_shape(llava())
    tower, lm = shape.blocks[0], shape.blocks[-1]
    assert not tower.cp_split and lm.cp_split
    assert layer_activation_bytes(tower, 1, 1, 2) == layer_activation_bytes(tower, 1, 1, 1)
    assert layer_activation_bytes(lm, 1, 1, 2) < layer_activation_bytes(lm, 1, 1, 1)


def test_t5_plans_under_cp_with_allgather_only():
    hardware = load_hardware("H100-SXM")
    args = ["--parallel.cp", "2", "--model.decoder_seq_len", "32"]
    with pytest.raises(ValueError, match=r"set parallel\.cp_method: allgather"):
        plan(load_config("configs/t5.yaml", args), 8, hardware)
    result = plan(load_config("configs/t5.yaml", [*args, "--parallel.cp_method", "allgather"]),
                  8, hardware)  # fmt: skip
    assert result.family == "t5" and result.layout["cp"] == 2
    # a decoder block also gathers the cross-attention's encoder K/V (as much again here)
    from mtcore.plan.stage import Stage, _communication

    config = with_data_vocab(
        load_config("configs/t5.yaml", [*args, "--parallel.cp_method", "allgather"])
    )
    shape, spec = model_shape(config.model), config.parallel.resolve(8)
    encoder, decoder = shape.blocks[0], replace(shape.blocks[-1], seq=shape.blocks[0].seq)

    def cp_seconds(block):
        stage = Stage(((block, 1),), False, False)
        # 512 sequences: bandwidth, not latency, decides
        return _communication(shape, stage, 512, spec, hardware, "none", 2, 1.0)["cp_comm"]

    assert cp_seconds(decoder) > 1.5 * cp_seconds(encoder) > 0


def test_a_frozen_tower_holds_weights_only_in_the_plan():
    """LLaVA stage 2 (tower frozen) against the same model trained whole, tp2 x pp2:
    stage 0 keeps the tower's weights but no gradients, master or optimizer state for
    it, none of its activations, and spends no backward on it."""
    from mtcore.plan.memory import layer_activation_bytes

    hardware = load_hardware("H100-SXM")
    whole = plan(load_config(LLAVA), 4, hardware)
    stage2 = plan(load_config(LLAVA, ["--model.freeze", "[vision]"]), 4, hardware)
    shape = model_shape(llava("--model.freeze", "[vision]"))
    holds = stage_params(shape, stage_blocks(shape, 2, 0), 2, 1, 2, True, False)
    rank = stage2.ranks[0]
    assert rank.params == round(holds.trained) and holds.frozen > 0
    assert rank.weights == pytest.approx(4 * (holds.trained + holds.frozen))  # fp32
    assert rank.grads == pytest.approx(4 * holds.trained)
    assert rank.optimizer == pytest.approx(8 * holds.trained)
    tower = shape.blocks[0]
    per_layer = layer_activation_bytes(tower, 8, 2, 1, False, "none", True, 4)
    kept = whole.ranks[0].activations - rank.activations
    assert kept == pytest.approx(rank.in_flight * llava().vision.num_layers * per_layer)
    assert stage2.time.total < whole.time.total  # no backward through the tower
    assert stage2.ranks[1] == whole.ranks[1]  # the last stage holds no part of the tower
