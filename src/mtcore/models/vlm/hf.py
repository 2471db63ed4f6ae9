"""HuggingFace ``LlavaForConditionalGeneration`` <-> mtcore llava: config and full weights.

A LLaVA directory is ``config.json`` (``model_type: llava`` with a CLIP
``vision_config`` and a Llama ``text_config``), the safetensors files and, usually, a
tokenizer and ``preprocessor_config.json``. The language model maps as the GPT family's
HF models do (``mtcore.models.common.decoder.hf``: Llama, and the Mistral, Qwen2 and Mixtral it
also reads; the tests use Llama); the rest is renaming and (un)fusing:

=============================================  =============================================
mtcore                                         HuggingFace (``vision_tower.`` / ``multi_modal_projector.``)
=============================================  =============================================
``vision.embed.weight`` ``[h, C p p]``         ``embeddings.patch_embedding.weight`` ``[h, C, p, p]``
``vision.embed.cls``, ``vision.embed.pos``     ``embeddings.class_embedding``, ``embeddings.position_embedding.weight``
``vision.pre_norm.*``                          ``pre_layrnorm.*``
``vision.layers.i.attn.qkv.*``                 ``encoder.layers.i.self_attn.{q,k,v}_proj.*`` (rows)
``vision.layers.i.attn.proj.*``                ``encoder.layers.i.self_attn.out_proj.*``
``vision.layers.i.{attn,mlp}_norm.*``          ``encoder.layers.i.layer_norm{1,2}.*``
``vision.layers.i.mlp.fc{1,2}.*``              ``encoder.layers.i.mlp.fc{1,2}.*``
``projector.fc{1,2}.*``                        ``linear_{1,2}.*``
=============================================  =============================================

LLaVA reads the hidden states of ``vision_feature_layer`` (-2: the second-to-last
layer's output); mtcore's tower ends there, so import keeps the layers up to it and
drops the rest and CLIP's ``post_layernorm`` (LLaVA never uses them); export writes
``vision_feature_layer: -1`` and an identity ``post_layernorm``. The ``default`` feature
strategy drops the class token (``keep_class_token: false``), ``full`` keeps it.
Import reads names of both the files transformers 5 writes
(``vision_tower.embeddings...``, ``language_model.model...``) and older ones
(``vision_tower.vision_model...``, ``model.language_model...``); export writes what the
installed transformers writes. The image processor's mean and std come from
``preprocessor_config.json`` when there is one (export writes a ``CLIPImageProcessor``
one with a square resize).

Refused, naming the setting: a vision tower other than CLIP's, several feature layers,
a projector activation other than ``gelu``, a ``tokenizer.json`` whose ``<image>`` id is
not ``image_token_index`` (mtcore marks image positions with the tokenizer's ``<image>``
and export writes that id, so import keeps the two equal); on export, a tower without class token or
``pre_norm``, a patch bias, a ``linear`` projector (HF's is always two layers), and a
checkpoint without the tokenizer that names ``<image>``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from pydantic import ValidationError
from torch import Tensor

from mtcore.models.common.decoder import hf as decoder_hf
from mtcore.models.common.decoder.config import DecoderConfig
from mtcore.models.common.hf_files import (
    DTYPE_NAMES,
    HFInteropError,
    TensorTaker,
    added_token_ids,
    as_interop_error,
    begin_of_sequence_token,
    check_model_type,
    copy_tokenizer,
    end_of_document_token,
    need,
    read_config,
    read_safetensors,
    read_tokenizer,
    write_json,
    write_weights_and_config,
)
from mtcore.models.vlm.config import LlavaConfig
from mtcore.models.vlm.image_samples import IMAGE_TOKEN
from mtcore.models.vlm.weights import check_full_weights, language_config

_ACTIVATIONS = ("quick_gelu", "gelu")
_RENAMES = (  # applied in order, each at most once: every naming -> one
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_LAYER = {  # mtcore name in vision layer i -> CLIP name in encoder layer i
    "attn.proj": "self_attn.out_proj",
    "attn_norm": "layer_norm1",
    "mlp_norm": "layer_norm2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


# -- config ----------------------------------------------------------------------------
def model_config_from_llava(
    hf: dict, seq_len: int | None = None, preprocessor: dict | None = None
) -> LlavaConfig:
    """The LlavaConfig of a HuggingFace LLaVA config.json (and preprocessor config)."""
    check_model_type(hf, "llava", "LLaVA", "llava")
    vision, text = need(hf, "vision_config"), need(hf, "text_config")
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise HFInteropError(
            f"vision_config.model_type={vision['model_type']!r}: mtcore maps CLIP's"
        )
    act = vision.get("hidden_act", "quick_gelu")
    if act not in _ACTIVATIONS:
        raise HFInteropError(f"vision_config.hidden_act={act!r}: mtcore's tower has {_ACTIVATIONS}")
    if hf.get("projector_hidden_act", "gelu") != "gelu":
        raise HFInteropError(
            f"projector_hidden_act={hf['projector_hidden_act']!r}: mtcore's is gelu"
        )
    strategy = hf.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise HFInteropError(f"vision_feature_select_strategy={strategy!r}: default or full map")
    language = decoder_hf.model_config_from_hf(
        text, seq_len, functools.partial(DecoderConfig, family="llava")
    )
    images = {}
    if preprocessor:
        images = {
            k: tuple(preprocessor[f"image_{k}"])
            for k in ("mean", "std")
            if f"image_{k}" in preprocessor
        }
    try:
        config = LlavaConfig(
            **{k: getattr(language, k) for k in type(language).model_fields if k != "family"},
            vision=dict(
                image_size=need(vision, "image_size"), patch_size=need(vision, "patch_size"),
                channels=vision.get("num_channels", 3), hidden_size=need(vision, "hidden_size"),
                num_layers=used_layers(hf), num_heads=need(vision, "num_attention_heads"),
                ffn_hidden_size=need(vision, "intermediate_size"), activation=act,
                keep_class_token=strategy == "full", norm_eps=vision.get("layer_norm_eps", 1e-5),
                init_std=vision.get("initializer_range", 0.02),
            ),
            images=images,
        )  # fmt: skip
    except ValidationError as e:
        raise HFInteropError(f"the LLaVA config does not make an mtcore model: {e}") from e
    seq = hf.get("image_seq_length")
    if seq is not None and seq != config.image_tokens:
        raise HFInteropError(
            f"image_seq_length={seq}, but the tower gives {config.image_tokens} image tokens"
        )
    return config


def used_layers(hf: dict) -> int:
    """The CLIP layers whose output LLaVA reads (``vision_feature_layer``)."""
    layer, total = (
        hf.get("vision_feature_layer", -2),
        need(hf["vision_config"], "num_hidden_layers"),
    )
    if not isinstance(layer, int):
        raise HFInteropError(f"vision_feature_layer={layer!r}: mtcore reads one layer")
    used = total + 1 + layer if layer < 0 else layer
    if not 1 <= used <= total:
        raise HFInteropError(
            f"vision_feature_layer={layer} of {total} layers reads no layer's output"
        )
    return used


def llava_config(
    config: LlavaConfig, image_token_id: int, dtype: torch.dtype = torch.float32
) -> dict:
    """The config.json of ``config`` as a HuggingFace ``LlavaForConditionalGeneration``."""
    _check_exportable(config)
    v = config.vision
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": image_token_id,
        "image_seq_length": config.image_tokens,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full" if v.keep_class_token else "default",
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": DTYPE_NAMES[dtype],
        "text_config": decoder_hf.hf_config(language_config(config), None, dtype),
        "vision_config": {
            "model_type": "clip_vision_model", "hidden_size": v.hidden_size,
            "intermediate_size": v.ffn_size, "num_hidden_layers": v.num_layers,
            "num_attention_heads": v.num_heads, "num_channels": v.channels,
            "image_size": v.image_size, "patch_size": v.patch_size, "hidden_act": v.activation,
            "layer_norm_eps": v.norm_eps, "attention_dropout": 0.0,
            "initializer_range": v.init_std, "projection_dim": v.hidden_size,
        },
    }  # fmt: skip


def _check_exportable(config: LlavaConfig) -> None:
    v = config.vision
    wrong = {
        "vision.class_token": (v.class_token, True),
        "vision.pre_norm": (v.pre_norm, True),
        "vision.patch_bias": (v.patch_bias, False),
        "projector": (config.projector, "mlp2x_gelu"),
    }
    bad = [
        f"{k}={have!r} (HF LLaVA needs {want!r})"
        for k, (have, want) in wrong.items()
        if have != want
    ]
    if bad:
        raise HFInteropError("this model cannot be exported as LLaVA: " + ", ".join(bad))


# -- weights ---------------------------------------------------------------------------
def _normalised(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for name, t in tensors.items():
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old) :]
        out[name] = t
    return out


def from_llava_tensors(config: LlavaConfig, tensors: dict[str, Tensor], total_layers: int,
                       projector_bias: bool = True) -> dict[str, Tensor]:  # fmt: skip
    """mtcore full weights (fp32) from LLaVA tensors; ``total_layers``: the CLIP tower's
    (those past ``config.vision.num_layers`` are dropped)."""
    tensors = _normalised(tensors)
    text = {k: t for k, t in tensors.items() if k.startswith(("model.", "lm_head."))}
    weights = decoder_hf.from_hf_tensors(language_config(config), text)
    source = TensorTaker({k: t for k, t in tensors.items() if k not in text})
    v, pre = config.vision, "vision_tower."
    weights["vision.embed.weight"] = source.take(pre + "embeddings.patch_embedding.weight").flatten(
        1
    )
    weights["vision.embed.cls"] = source.take(pre + "embeddings.class_embedding")
    weights["vision.embed.pos"] = source.take(pre + "embeddings.position_embedding.weight")
    for t in ("weight", "bias"):
        weights[f"vision.pre_norm.{t}"] = source.take(f"{pre}pre_layrnorm.{t}")
        source.take(f"{pre}post_layernorm.{t}")  # LLaVA never reads it
    for i in range(total_layers):
        theirs = f"{pre}encoder.layers.{i}."
        if i >= v.num_layers:  # past the feature layer: unused
            for name in [k for k in source.tensors if k.startswith(theirs)]:
                source.take(name)
            continue
        mine = f"vision.layers.{i}."
        for t in ("weight", "bias"):
            weights[f"{mine}attn.qkv.{t}"] = torch.cat(
                [source.take(f"{theirs}{q}.{t}") for q in _QKV]
            )
            for m, h in _VISION_LAYER.items():
                weights[f"{mine}{m}.{t}"] = source.take(f"{theirs}{h}.{t}")
    for k in (1, 2):
        weight = source.take(f"multi_modal_projector.linear_{k}.weight")
        weights[f"projector.fc{k}.weight"] = weight
        bias = f"multi_modal_projector.linear_{k}.bias"
        weights[f"projector.fc{k}.bias"] = (
            source.take(bias) if projector_bias else torch.zeros(weight.shape[0])
        )
    source.refuse_untaken("a LLaVA model", ignored_suffix="position_ids")
    with as_interop_error():
        check_full_weights(config, weights, "the imported tensors")
    return weights


def to_llava_tensors(config: LlavaConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """LLaVA tensors under the names the installed transformers writes."""
    _check_exportable(config)
    check_full_weights(config, weights, "the weights to export")
    lm = {k: t for k, t in weights.items() if not k.startswith(("vision.", "projector."))}
    out = {}
    for name, t in decoder_hf.to_hf_tensors(language_config(config), lm).items():
        out[("language_model." + name) if name.startswith(("model.", "lm_head.")) else name] = t
    v, pre = config.vision, "vision_tower."
    h = v.hidden_size
    out[pre + "embeddings.patch_embedding.weight"] = weights["vision.embed.weight"].view(
        h, v.channels, v.patch_size, v.patch_size
    )
    out[pre + "embeddings.class_embedding"] = weights["vision.embed.cls"]
    out[pre + "embeddings.position_embedding.weight"] = weights["vision.embed.pos"]
    for t in ("weight", "bias"):
        out[f"{pre}pre_layrnorm.{t}"] = weights[f"vision.pre_norm.{t}"]
    out[f"{pre}post_layernorm.weight"], out[f"{pre}post_layernorm.bias"] = (
        torch.ones(h),
        torch.zeros(h),
    )
    for i in range(v.num_layers):
        mine, theirs = f"vision.layers.{i}.", f"{pre}encoder.layers.{i}."
        for t in ("weight", "bias"):
            for q, part in zip(_QKV, weights[f"{mine}attn.qkv.{t}"].split(h), strict=True):
                out[f"{theirs}{q}.{t}"] = part
            for m, hf_name in _VISION_LAYER.items():
                out[f"{theirs}{hf_name}.{t}"] = weights[f"{mine}{m}.{t}"]
    for k in (1, 2):
        for t in ("weight", "bias"):
            out[f"multi_modal_projector.linear_{k}.{t}"] = weights[f"projector.fc{k}.{t}"]
    return out


# -- directories -----------------------------------------------------------------------
def import_llava(
    hf_dir: str | Path, seq_len: int | None = None
) -> tuple[LlavaConfig, dict[str, Tensor]]:
    """The LlavaConfig and fp32 full weights of a HuggingFace LLaVA directory."""
    directory = Path(hf_dir)
    hf = read_config(directory)
    preprocessor = None
    if (directory / "preprocessor_config.json").is_file():
        preprocessor = json.loads((directory / "preprocessor_config.json").read_text())
    config = model_config_from_llava(hf, seq_len, preprocessor)
    check_image_token(hf, directory / "tokenizer.json")
    total = need(hf["vision_config"], "num_hidden_layers")
    bias = bool(hf.get("multimodal_projector_bias", True))
    return config, from_llava_tensors(config, read_safetensors(directory), total, bias)


def check_image_token(hf: dict, tokenizer_json: Path) -> None:
    """Refuse a config.json whose ``image_token_index`` is not the id of ``<image>`` in the
    directory's tokenizer.json: transformers looks for images at the config's id while the
    processor writes the tokenizer's. A missing or unreadable tokenizer.json, or one
    without ``<image>``, leaves nothing to compare: ``mtcore convert`` then carries no
    tokenizer, and export writes the id of the tokenizer it is given."""
    wanted = hf.get("image_token_index", hf.get("image_token_id"))
    if wanted is None or not tokenizer_json.is_file():
        return
    try:
        found = added_token_ids(read_tokenizer(tokenizer_json)).get(IMAGE_TOKEN)
    except HFInteropError:  # unreadable: convert warns that it carries no tokenizer
        return
    if found is not None and found != wanted:
        raise HFInteropError(
            f"config.json has image_token_index={wanted} but {tokenizer_json.name} has "
            f"{IMAGE_TOKEN} at id {found}: transformers would look for images at one and the "
            "processor would write the other; make them agree before converting"
        )


def export_llava(
    model_config: LlavaConfig,
    full_weights: dict[str, Tensor],
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    tokenizer_json: str | Path | None = None,
) -> Path:
    """Write a HuggingFace LLaVA directory (config.json, model.safetensors, the tokenizer,
    a CLIP preprocessor_config.json and a processor_config.json) that
    ``LlavaForConditionalGeneration`` and ``AutoProcessor`` load."""
    if dtype not in DTYPE_NAMES:
        raise HFInteropError(f"dtype {dtype} is not one of {sorted(decoder_hf.DTYPES)}")
    if tokenizer_json is None:
        raise HFInteropError(
            f"a LLaVA export needs the checkpoint's tokenizer.json (it names {IMAGE_TOKEN})"
        )
    ids = added_token_ids(read_tokenizer(Path(tokenizer_json)))
    if ids.get(IMAGE_TOKEN) is None:
        raise HFInteropError(f"tokenizer {tokenizer_json} has no {IMAGE_TOKEN} token")
    config = llava_config(model_config, ids[IMAGE_TOKEN], dtype)
    tensors = to_llava_tensors(model_config, full_weights)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    eos = end_of_document_token(Path(tokenizer_json))
    bos = begin_of_sequence_token(Path(tokenizer_json)) or eos  # the tokenizer's own, if any
    settings = {"bos_token": bos[0], "eos_token": eos[0]} if eos else {}
    copy_tokenizer(out, tokenizer_json, model_config.seq_len, **settings)
    if eos is not None:
        text = config["text_config"]
        text["bos_token_id"], text["eos_token_id"] = bos[1], eos[1]
    size, images = model_config.vision.image_size, model_config.images
    write_json(out / "preprocessor_config.json", {
        "image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"height": size, "width": size},
        "do_center_crop": False, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": list(images.mean), "image_std": list(images.std), "resample": 3,
        "do_convert_rgb": True,
    })  # fmt: skip
    write_json(out / "processor_config.json", {
        "processor_class": "LlavaProcessor", "image_token": IMAGE_TOKEN,
        "patch_size": model_config.vision.patch_size,
        "vision_feature_select_strategy": config["vision_feature_select_strategy"],
        "num_additional_image_tokens": 1,  # the class token (export requires one)
    })  # fmt: skip
    write_weights_and_config(out, config, tensors, dtype)
    return out
