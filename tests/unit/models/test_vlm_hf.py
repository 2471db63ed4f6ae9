"""HuggingFace LLaVA interop in one process: import gives transformers' logits, export
loads in transformers and round-trips bitwise, `mtcore convert` both ways, refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tokenizers
import torch
from tiny_llava import IMAGE_ID, hf_llava, inputs

from mtcore.backend import select_backend
from mtcore.cli.main import main
from mtcore.data.tokenizer import Tokenizer, train_tokenizer
from mtcore.models.common.hf_files import HFInteropError
from mtcore.models.common.layers import single_context
from mtcore.models.vlm import Llava, LlavaConfig
from mtcore.models.vlm.hf import export_llava, import_llava, model_config_from_llava

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def ours(config: LlavaConfig, weights) -> Llava:
    model = Llava(config, single_context(config, select_backend("cpu"))).eval()
    model.load_state_dict(weights)
    return model


def tokenizer_json(path) -> str:
    """A byte-level BPE with ``<image>`` at id ``TOKENIZER_IMAGE_ID`` (not tiny_llava's 5)."""
    hf = train_tokenizer(
        ["USER: what is in the image ASSISTANT: two red squares"] * 4, 300, ["<image>"]
    )
    tok = Tokenizer(hf, None, ["<image>"])
    assert tok.token_id("<image>") == TOKENIZER_IMAGE_ID != IMAGE_ID
    path.write_text(tok.hf.to_str())
    return str(path)


TOKENIZER_IMAGE_ID = 1


@pytest.mark.parametrize(
    "layers, feature_layer, strategy", [(3, -2, "default"), (2, -1, "full"), (3, 1, "default")]
)
def test_an_imported_llava_gives_transformers_logits(tmp_path, layers, feature_layer, strategy):
    model = hf_llava(layers, feature_layer, strategy)
    model.save_pretrained(tmp_path)
    config, weights = import_llava(tmp_path)
    used = layers + 1 + feature_layer if feature_layer < 0 else feature_layer
    assert config.vision.num_layers == used and config.vision.keep_class_token is (
        strategy == "full"
    )
    batch, ids, pixels = inputs(config.image_tokens)
    with torch.no_grad():
        want = model(input_ids=ids, pixel_values=pixels).logits
        got = ours(config, weights)(batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_export_loads_in_transformers_and_round_trips(tmp_path):
    hf_llava().save_pretrained(tmp_path / "hf")
    config, weights = import_llava(tmp_path / "hf")
    out = export_llava(
        config, weights, tmp_path / "out", tokenizer_json=tokenizer_json(tmp_path / "t.json")
    )
    again_config, again = import_llava(out)
    assert again_config.structure() == config.structure()
    assert set(again) == set(weights) and all(torch.equal(again[k], weights[k]) for k in weights)
    exported = json.loads((out / "config.json").read_text())
    saved = Tokenizer(
        tokenizers.Tokenizer.from_file(str(out / "tokenizer.json")), None, ["<image>"]
    )
    assert exported["image_token_index"] == saved.token_id("<image>")
    model = transformers.LlavaForConditionalGeneration.from_pretrained(out).eval()
    batch, ids, pixels = inputs()
    ids = ids.masked_fill(ids == IMAGE_ID, exported["image_token_index"])
    batch["tokens"] = ids
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, pixel_values=pixels).logits,
                                   ours(config, weights)(batch), atol=1e-5, rtol=1e-5)  # fmt: skip
    processor = json.loads((out / "preprocessor_config.json").read_text())
    assert processor["image_mean"] == list(config.images.mean)


def test_older_names_import_too(tmp_path):
    """``vision_tower.vision_model.*`` and ``model.language_model.*`` (other transformers
    versions) map like the names transformers 5 writes."""
    from safetensors.torch import load_file, save_file

    hf_llava().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    renamed = {
        k.replace("vision_tower.", "vision_tower.vision_model.").replace("language_model.model.", "model.language_model.")
        .replace("language_model.lm_head.", "lm_head."): v for k, v in tensors.items()
    }  # fmt: skip
    _, want = import_llava(tmp_path)
    save_file(renamed, tmp_path / "model.safetensors")
    _, got = import_llava(tmp_path)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_what_does_not_map_is_refused_naming_it(tmp_path):
    base = hf_llava().config.to_dict()
    for change, message in [
        ({"projector_hidden_act": "relu"}, "projector_hidden_act='relu'"),
        ({"vision_feature_layer": [-2, -1]}, "vision_feature_layer=\\[-2, -1\\]"),
        ({"vision_feature_layer": -4}, "reads no layer's output"),
        ({"image_seq_length": 9}, "image_seq_length=9, but the tower gives 4"),
        ({"vision_feature_select_strategy": "pooled"}, "vision_feature_select_strategy='pooled'"),
    ]:
        with pytest.raises(HFInteropError, match=message):
            model_config_from_llava({**base, **change})
    bad_vision = {
        **base,
        "vision_config": {**base["vision_config"], "model_type": "siglip_vision_model"},
    }
    with pytest.raises(HFInteropError, match="siglip_vision_model"):
        model_config_from_llava(bad_vision)
    config = LlavaConfig(vocab_size=64, seq_len=32, hidden_size=32, num_heads=4, projector="linear")
    weights = Llava(config, single_context(config, select_backend("cpu"))).state_dict()
    with pytest.raises(
        HFInteropError, match="projector='linear' \\(HF LLaVA needs 'mlp2x_gelu'\\)"
    ):
        export_llava(
            config, weights, tmp_path / "x", tokenizer_json=tokenizer_json(tmp_path / "t.json")
        )
    with pytest.raises(HFInteropError, match=r"needs the checkpoint.s tokenizer\.json"):
        export_llava(config.model_copy(update={"projector": "mlp2x_gelu"}), weights, tmp_path / "y")


def test_an_image_token_index_the_tokenizer_disagrees_with_is_refused_in_one_line(tmp_path, capsys):
    hf_llava().save_pretrained(tmp_path / "hf")  # image_token_index 5
    tokenizer_json(tmp_path / "hf" / "tokenizer.json")  # <image> at 1
    capsys.readouterr()  # transformers' progress bar
    message = (
        "config.json has image_token_index=5 but tokenizer.json has <image> at id 1: "
        "transformers would look for images at one and the processor would write the other; "
        "make them agree before converting"
    )
    with pytest.raises(HFInteropError) as err:
        import_llava(tmp_path / "hf")
    assert str(err.value) == message
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 2
    assert capsys.readouterr().err == f"mtcore convert from-hf: error: {message}\n"
    assert not (tmp_path / "ckpt").exists()


def test_the_image_id_survives_import_and_export_for_transformers_processor(tmp_path):
    """A LLaVA whose config and tokenizer agree on <image> (id 1) exports with that id, and
    transformers' own processor (AutoProcessor, from the export's processor_config.json)
    and model run the export: images where the processor expands <image>, as many image
    tokens as image features."""
    hf_llava(image_id=TOKENIZER_IMAGE_ID).save_pretrained(tmp_path / "hf")
    tokenizer = tokenizer_json(tmp_path / "hf" / "tokenizer.json")
    config, weights = import_llava(tmp_path / "hf")
    out = export_llava(config, weights, tmp_path / "out", tokenizer_json=tokenizer)
    assert json.loads((out / "config.json").read_text())["image_token_index"] == 1
    processor = transformers.AutoProcessor.from_pretrained(out)
    assert isinstance(processor, transformers.LlavaProcessor)
    image = np.random.default_rng(0).integers(0, 255, (8, 8, 3), dtype=np.uint8)
    encoded = processor(text="<image>!", images=image, return_tensors="pt")
    ids = encoded["input_ids"]
    assert ids.tolist() == [[1] * config.image_tokens + [ids[0, -1].item()]]
    model = transformers.LlavaForConditionalGeneration.from_pretrained(out).eval()
    slots = encoded["pixel_values"][:, None]
    batch = {"tokens": ids, "image_mask": ids == 1, "pixel_values": slots}
    with torch.no_grad():
        torch.testing.assert_close(
            model(**encoded).logits, ours(config, weights)(batch), atol=1e-5, rtol=1e-5
        )


@pytest.mark.slow
def test_convert_cli_both_ways(tmp_path, run_mtcore):
    hf_llava(image_id=TOKENIZER_IMAGE_ID).save_pretrained(tmp_path / "hf")
    tokenizer_json(tmp_path / "hf" / "tokenizer.json")
    run = run_mtcore("convert", "from-hf", tmp_path / "hf", tmp_path / "ckpt")
    assert run.returncode == 0, run.stderr
    run = run_mtcore("convert", "to-hf", tmp_path / "ckpt", tmp_path / "back", "--dtype", "fp32")
    assert run.returncode == 0, run.stderr
    _, want = import_llava(tmp_path / "hf")
    _, got = import_llava(tmp_path / "back")
    assert all(torch.equal(got[k], want[k]) for k in want)
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["image_token_index"] == TOKENIZER_IMAGE_ID
