"""HuggingFace T5 format <-> mtcore T5: config and full weights.

A HuggingFace T5 directory is ``config.json`` (``model_type`` "t5") plus
``model.safetensors`` (or shards), a ``T5ForConditionalGeneration``. transformers is
not needed to read or write it. The names map one to one, q/k/v and wi_0/wi_1 fused on
mtcore's side (``mtcore.models.t5.weights.hf_names``). The shared embedding is
``shared.weight``; the encoder's and decoder's ``embed_tokens`` are the same tensor and
an untied v1.1 head is ``lm_head.weight``.

Refused, naming the field: a feed-forward other than v1.1's ``gated-gelu`` (the
original T5's ``relu``, ``gated-silu``...), a config that is not an encoder-decoder,
a tied config whose file carries a head that differs from the embedding. A
transformers-5 file of a v1.1 model (``scale_decoder_outputs: false``, its head the
embedding) imports as an untied head initialised from the embedding. HF's
``dropout_rate`` drops hidden states and attention probabilities alike: it imports as
both ``dropout`` and ``attention_dropout``, and a model whose ``attention_dropout`` is
neither 0 nor its ``dropout`` is refused on export (one rate cannot hold both).
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import ValidationError
from torch import Tensor

from mtcore.models.common.hf_files import (
    DTYPE_NAMES,
    HFInteropError,
    TensorTaker,
    added_token_ids,
    as_interop_error,
    check_model_type,
    copy_tokenizer,
    need,
    read_config,
    read_safetensors,
    read_tokenizer,
    write_weights_and_config,
)
from mtcore.models.t5.config import T5Config
from mtcore.models.t5.weights import check_full_weights, hf_names, to_hf_tensors

_TIED_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
DEFAULT_SEQ_LEN = 512  # T5's pre-training input length; a T5 has no position table


def t5_config(config: T5Config, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json of ``config`` as a HuggingFace T5ForConditionalGeneration."""
    if config.vocab_size is None:
        raise HFInteropError("model.vocab_size is unset: fill it in with config.with_vocab(...)")
    if config.attention_dropout not in (0.0, config.dropout):
        raise HFInteropError(
            f"attention_dropout={config.attention_dropout} differs from dropout="
            f"{config.dropout}: HF T5's one dropout_rate drops both"
        )
    return {
        "architectures": ["T5ForConditionalGeneration"],
        "model_type": "t5",
        "vocab_size": config.vocab_size,
        "d_model": config.hidden_size,
        "d_kv": config.kv_dim,
        "d_ff": config.ffn_size,
        "num_layers": config.encoder_layers,
        "num_decoder_layers": config.decoder_layers,
        "num_heads": config.num_heads,
        "relative_attention_num_buckets": config.relative_buckets,
        "relative_attention_max_distance": config.relative_max_distance,
        "dropout_rate": config.dropout,
        "layer_norm_epsilon": config.norm_eps,
        "initializer_factor": config.init_factor,
        "feed_forward_proj": "gated-gelu",
        "is_encoder_decoder": True,
        "tie_word_embeddings": config.tie_embeddings,
        "use_cache": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
        "n_positions": config.seq_len,
        "torch_dtype": DTYPE_NAMES[dtype],
    }


def _check_importable(hf: dict) -> None:
    check_model_type(hf, "t5", "T5", "T5")
    proj = hf.get("feed_forward_proj", "relu")
    if proj != "gated-gelu":
        raise HFInteropError(
            f"feed_forward_proj={proj!r}: mtcore's T5 implements v1.1's gated-GELU "
            "feed-forward only ('gated-gelu')"
        )
    if hf.get("is_encoder_decoder") is False or hf.get("is_decoder"):
        raise HFInteropError(
            "is_encoder_decoder=false: mtcore's T5 is the encoder-decoder "
            "T5ForConditionalGeneration"
        )


def rescales(hf: dict) -> bool:
    """Whether the decoder output is scaled by ``d_model ** -0.5`` before the head (the
    original T5's tied head). transformers 5 says so in ``scale_decoder_outputs`` and
    always writes ``tie_word_embeddings: true``; earlier versions tie (and scale)
    exactly when ``tie_word_embeddings`` is true (v1.1: false)."""
    if "scale_decoder_outputs" in hf:
        return bool(hf["scale_decoder_outputs"])
    return bool(hf.get("tie_word_embeddings", True))


def model_config_from_t5(hf: dict, seq_len: int | None = None) -> T5Config:
    """The mtcore T5Config of a HuggingFace T5 config.json (a dict). ``seq_len``: the
    encoder length to train at (None: ``n_positions``, else 512)."""
    _check_importable(hf)
    encoder_layers = need(hf, "num_layers")
    try:
        return T5Config(
            vocab_size=need(hf, "vocab_size"),
            hidden_size=need(hf, "d_model"),
            head_dim=need(hf, "d_kv"),
            ffn_hidden_size=need(hf, "d_ff"),
            encoder_layers=encoder_layers,
            decoder_layers=hf.get("num_decoder_layers") or encoder_layers,
            num_heads=need(hf, "num_heads"),
            relative_buckets=hf.get("relative_attention_num_buckets", 32),
            relative_max_distance=hf.get("relative_attention_max_distance", 128),
            dropout=hf.get("dropout_rate", 0.1),
            attention_dropout=hf.get("dropout_rate", 0.1),
            norm_eps=hf.get("layer_norm_epsilon", 1e-6),
            init_factor=hf.get("initializer_factor", 1.0),
            tie_embeddings=rescales(hf),
            seq_len=seq_len or hf.get("n_positions") or DEFAULT_SEQ_LEN,
        )
    except ValidationError as e:
        raise HFInteropError(f"the T5 config does not make an mtcore model: {e}") from e


def from_t5_tensors(config: T5Config, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """mtcore full weights (fp32) from HuggingFace T5 tensors; refuses missing,
    unexpected or misshapen tensors, and a tied copy that differs, naming them."""
    if not config.tie_embeddings and "lm_head.weight" not in tensors:
        # transformers 5 ties v1.1's head to the embedding without the rescale: the
        # same function as an untied head that starts as a copy of it.
        tensors = {**tensors, "lm_head.weight": tensors.get("shared.weight")}
    source = TensorTaker(tensors)
    weights = {
        mine: torch.cat([source.take(t) for t in theirs], dim=0)
        for mine, theirs in hf_names(config).items()
    }
    copies = _TIED_COPIES + (("lm_head.weight",) if config.tie_embeddings else ())
    for copy in copies:
        if copy in source and not torch.equal(source.take(copy), weights["embed.weight"]):
            raise HFInteropError(
                f"{copy} differs from shared.weight, which it is tied to "
                "(tie_word_embeddings); cannot map an untied copy"
            )
    source.refuse_untaken("mtcore's T5")
    with as_interop_error():
        check_full_weights(config, weights, "the imported tensors")
    return weights


def import_t5(hf_dir: str | Path, seq_len: int | None = None) -> tuple[T5Config, dict[str, Tensor]]:
    """The T5Config and fp32 full weights (``T5(config).state_dict()`` names) of a
    HuggingFace T5 directory."""
    directory = Path(hf_dir)
    hf = read_config(directory)
    config = model_config_from_t5(hf, seq_len)
    return config, from_t5_tensors(config, read_safetensors(directory))


def export_t5(
    model_config: T5Config,
    full_weights: dict[str, Tensor],
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    tokenizer_json: str | Path | None = None,
) -> Path:
    """Write a HuggingFace T5 directory (config.json, model.safetensors and, when given,
    tokenizer.json with a tokenizer_config.json) that ``T5ForConditionalGeneration
    .from_pretrained`` loads. Returns ``out_dir``."""
    if dtype not in DTYPE_NAMES:
        raise HFInteropError(f"dtype {dtype} is not one of {list(DTYPE_NAMES.values())}")
    config = t5_config(model_config, dtype)
    with as_interop_error():
        tensors = to_hf_tensors(model_config, full_weights)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_json is not None:
        ids = added_token_ids(read_tokenizer(Path(tokenizer_json)))
        special = {
            role: t for role, t in (("pad_token", "<pad>"), ("eos_token", "</s>")) if t in ids
        }
        extra = [t for t in ids if t.startswith("<extra_id_")]
        copy_tokenizer(
            out, tokenizer_json, model_config.seq_len, **special, additional_special_tokens=extra
        )
        if "pad_token" in special:
            config["pad_token_id"] = config["decoder_start_token_id"] = ids["<pad>"]
        if "eos_token" in special:
            config["eos_token_id"] = ids["</s>"]
    write_weights_and_config(out, config, tensors, dtype)
    return out
