"""The family contracts are checked where they are met, each refusal one line naming the
family and the member: a family when the registry hands it out (``check_family``), its
chunks on every ``build``, its config class when instantiated; and what a built-in
family declares in ``capabilities`` is what it does."""

from __future__ import annotations

from typing import Literal

import pytest
from torch import nn

from mtcore.backend import select_backend
from mtcore.models import (
    BuiltModel,
    Capabilities,
    FamilyConfig,
    FamilyError,
    HFAdapter,
    MegatronAdapter,
    ModelFamily,
    check_family,
    family_names,
    get_family,
)
from mtcore.models.gpt import GPTConfig
from mtcore.models.gpt.family import GPTFamily
from mtcore.parallel.context import METHODS
from mtcore.parallel.layout import LayoutError, LayoutSpec, ParallelLayout

SMALL = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, seq_len=16)


class _TinyConfig(GPTConfig):
    family: Literal["tiny"] = "tiny"


class _Tiny(GPTFamily):
    name, config = "tiny", _TinyConfig


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_every_builtin_family_keeps_the_contract():
    for name in family_names():
        family = get_family(name)
        assert check_family(family) is family
        assert family.name == name and family.config.model_fields["family"].default == name


def test_a_family_missing_a_member_cannot_exist():
    class NoData(ModelFamily):
        name, config = "nodata", _TinyConfig

        def build_chunks(self, config, layout, backend, seed=0, fp8=None): ...
        def one_process(self, config, backend=None): ...
        def messages(self, config, layout, micro_batch_size, dtype): ...
        def loss_counts(self, config, batch): ...

    with pytest.raises(TypeError, match=r"NoData.*data"):
        NoData()
    with pytest.raises(FamilyError, match=r"^object .*is not a mtcore\.models\.ModelFamily$") as e:
        check_family(object(), "plugin p")
    assert "plugin p" in _one_line(e)


@pytest.mark.parametrize(
    ("change", "member"),
    [
        (dict(name="other"), "config must be a FamilyConfig subclass"),
        (dict(capabilities=Capabilities(generates=False)), "capabilities.generates=False"),
        (
            dict(capabilities=Capabilities(reads_images=True), generate=ModelFamily.generate),
            "reads_images=True",
        ),
        (dict(hf="llama"), "hf must be"),
        (dict(loss_counts=lambda self, config: {}), "loss_counts(...) breaks the contract"),
        (dict(generate=lambda self, model, tokenizer, prompt: ""), "generate(...) breaks"),
    ],
)
def test_check_family_names_the_family_and_the_member(change, member):
    broken = type("Broken", (_Tiny,), change)()
    with pytest.raises(FamilyError) as e:
        check_family(broken, "plugin p")
    message = _one_line(e)
    assert member in message and "plugin p" in message, message
    assert f"model family {broken.name!r}" in message or "Broken" in message


def test_build_checks_every_chunk_and_the_declared_moe():
    class Bare(nn.Module):
        first = last = True
        tp = None

    class BareChunks(_Tiny):
        def build_chunks(self, config, layout, backend, seed=0, fp8=None):
            return BuiltModel([Bare()], None)

    config = _TinyConfig(**SMALL)
    with pytest.raises(FamilyError) as e:
        BareChunks().build(config, ParallelLayout.single(), None)
    assert (
        _one_line(e)
        == "model family 'tiny': chunk 0 (Bare) has no 'stage' (mtcore.models.PipelineStage)"
    )

    class Dense(_Tiny):
        capabilities = Capabilities(generates=True)

    moe = _TinyConfig(**SMALL, moe=dict(num_experts=2, top_k=1, ffn_size=16))
    with pytest.raises(FamilyError, match=r"capabilities\.mixture_of_experts") as e:
        Dense().build(moe, ParallelLayout.single(), None)
    _one_line(e)


def test_a_chunk_without_its_layers_fails_the_build_check_in_one_line():
    """The engine hands ``chunk.layers`` to ZeRO-3 as its units: a chunk that keeps every
    other member but not its blocks by layer index is refused at build, not in the engine."""

    class NoLayers(_Tiny):
        def build_chunks(self, config, layout, backend, seed=0, fp8=None):
            built = super().build_chunks(config, layout, backend, seed, fp8)
            for chunk in built.chunks:
                chunk.blocks = chunk.layers  # under another name
                del chunk.layers
            return built

    class ListedLayers(_Tiny):
        def build_chunks(self, config, layout, backend, seed=0, fp8=None):
            built = super().build_chunks(config, layout, backend, seed, fp8)
            for chunk in built.chunks:
                chunk.layers = nn.ModuleList(chunk.layers.values())
            return built

    config = _TinyConfig(**SMALL)
    layout, backend = ParallelLayout.single(), select_backend("cpu")
    assert all(hasattr(c, "layers") for c in _Tiny().build(config, layout, backend).chunks)
    with pytest.raises(FamilyError) as e:
        NoLayers().build(config, layout, backend)
    assert _one_line(e) == (
        "model family 'tiny': chunk 0 (GPT) has no 'layers' (mtcore.models.PipelineStage)"
    )
    with pytest.raises(FamilyError) as e:
        ListedLayers().build(config, layout, backend)
    assert "chunk 0 (GPT) has 'layers' of type ModuleList, not a mapping" in _one_line(e)


def test_a_family_config_must_answer_the_abstract_questions():
    class Half(FamilyConfig):
        family: Literal["half"] = "half"

        def check_layout(self, spec) -> None:
            pass

    with pytest.raises(TypeError, match=r"flops_per_step.*num_params|num_params.*flops_per_step"):
        Half()


@pytest.mark.parametrize("name", ["gpt", "bert", "t5", "llava"])
def test_declared_capabilities_are_what_the_family_does(name):
    family = get_family(name)
    caps = family.capabilities
    # T5's derived decoder length (29 for 128 inputs) does not split into 2*cp chunks
    config = family.config(**({"decoder_seq_len": 32} if name == "t5" else {}))
    takes_cp = False
    for method in METHODS:  # T5 takes allgather only
        try:
            config.check_layout(LayoutSpec(cp=2, cp_method=method).resolve(2))
            takes_cp = True
        except LayoutError:
            pass
    assert takes_cp is caps.context_parallel, name
    assert ("moe" in family.config.model_fields) is caps.mixture_of_experts, name
    overridden = type(family).generate is not ModelFamily.generate
    assert overridden is caps.generates, name
    if not caps.generates:
        with pytest.raises(FamilyError, match=f"the {name} family does not generate text"):
            family.generate(None, None, "", 1)


def test_a_family_whose_adapter_leaves_a_method_out_is_refused_in_one_line():
    class HalfHF(HFAdapter):
        model_types = ("tiny",)

        @staticmethod
        def import_dir(path, seq_len): ...

    class HalfMegatron(get_family("gpt").megatron):
        to_ranks = MegatronAdapter.to_ranks  # the abstract method, left undefined

    class WrongArguments(HFAdapter):
        model_types = ("tiny",)

        @staticmethod
        def import_dir(path): ...

        @staticmethod
        def export_dir(config, weights, out_dir, dtype, tokenizer_json=None): ...

    for change, expected in [
        (dict(hf=HalfHF), "hf (HalfHF) does not define export_dir (mtcore.models.HFAdapter)"),
        (dict(megatron=HalfMegatron), "megatron (HalfMegatron) does not define to_ranks"),
        (dict(hf=WrongArguments), "hf.import_dir(...) breaks the contract"),
        (dict(hf=HalfHF.__mro__[1]), "hf (HFAdapter) does not define export_dir, import_dir"),
        (dict(megatron=object), "megatron must be a subclass of mtcore.models.MegatronAdapter"),
    ]:
        broken = type("Broken", (_Tiny,), change)()
        with pytest.raises(FamilyError) as e:
            check_family(broken, "plugin p")
        message = _one_line(e)
        assert message.startswith(f"model family 'tiny' (plugin p): {expected}"), message
