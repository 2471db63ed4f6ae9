"""HuggingFace BERT format <-> mtcore BERT: config and full weights.

A HuggingFace BERT directory is ``config.json`` (``model_type`` "bert") plus
``model.safetensors`` (or shards listed in ``model.safetensors.index.json``). A model
with a pair head is a ``BertForPreTraining``, one without (``pair_task: none``) a
``BertForMaskedLM``. transformers is not needed to read or write them.

The two compute the same function, so the mapping is renaming and (un)fusing
(``bert.`` prefixes ``embeddings``, ``encoder.layer.i`` and ``pooler``):

====================================  ==================================================
mtcore (``Bert(config).state_dict()``)  HuggingFace
====================================  ==================================================
``embed.word.weight``                 ``embeddings.word_embeddings.weight`` (decoder too)
``embed.position``                    ``embeddings.position_embeddings.weight``
``embed.token_type``                  ``embeddings.token_type_embeddings.weight``
``embed.norm.*``                      ``embeddings.LayerNorm.*``
``layers.i.attn.qkv.*``               ``attention.self.query | key | value`` (rows)
``layers.i.attn.proj.*``              ``attention.output.dense.*``
``layers.i.attn_norm.*``              ``attention.output.LayerNorm.*``
``layers.i.mlp.fc1.*``                ``intermediate.dense.*``
``layers.i.mlp.fc2.*``                ``output.dense.*``
``layers.i.mlp_norm.*``               ``output.LayerNorm.*``
``pooler.*``                          ``pooler.dense.*``
``mlm.dense.*`` / ``mlm.norm.*``      ``cls.predictions.transform.dense / LayerNorm.*``
``mlm.bias``                          ``cls.predictions.bias``
``pair.*``                            ``cls.seq_relationship.*``
====================================  ==================================================

The vocabulary keeps its size both ways (an export of a padded mtcore vocab has the
padded size: transformers accepts an embedding larger than the tokenizer).
``attention_probs_dropout_prob`` is ``attention_dropout`` both ways (mtcore's mask is
its own, so training draws other masks than transformers'). Whatever does not map is refused with an ``HFInteropError`` naming
it: an activation other than exact GELU, relative position embeddings, decoder or
cross-attention configs, untied decoders, encoders without biases.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import ValidationError
from torch import Tensor

from mtcore.models.bert.config import BertConfig
from mtcore.models.bert.weights import check_full_weights
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

# Special tokens a BERT tokenizer config names, and the spellings looked for.
_SPECIAL = {
    "cls_token": ("[CLS]", "<cls>", "<s>"),
    "sep_token": ("[SEP]", "<sep>", "</s>"),
    "mask_token": ("[MASK]", "<mask>"),
    "pad_token": ("[PAD]", "<pad>"),
    "unk_token": ("[UNK]", "<unk>"),
}
_LAYER = {  # mtcore name in layer i -> HF name in bert.encoder.layer.i (weight and bias)
    "attn.proj": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm",
    "mlp.fc1": "intermediate.dense",
    "mlp.fc2": "output.dense",
    "mlp_norm": "output.LayerNorm",
}
_QKV = ("attention.self.query", "attention.self.key", "attention.self.value")
_OUTSIDE = {  # mtcore name -> HF name, outside the layers
    "embed.word.weight": "bert.embeddings.word_embeddings.weight",
    "embed.position": "bert.embeddings.position_embeddings.weight",
    "embed.token_type": "bert.embeddings.token_type_embeddings.weight",
    "embed.norm.weight": "bert.embeddings.LayerNorm.weight",
    "embed.norm.bias": "bert.embeddings.LayerNorm.bias",
    "mlm.dense.weight": "cls.predictions.transform.dense.weight",
    "mlm.dense.bias": "cls.predictions.transform.dense.bias",
    "mlm.norm.weight": "cls.predictions.transform.LayerNorm.weight",
    "mlm.norm.bias": "cls.predictions.transform.LayerNorm.bias",
    "mlm.bias": "cls.predictions.bias",
}
_PAIR = {
    "pooler.weight": "bert.pooler.dense.weight",
    "pooler.bias": "bert.pooler.dense.bias",
    "pair.weight": "cls.seq_relationship.weight",
    "pair.bias": "cls.seq_relationship.bias",
}


def _names(config: BertConfig) -> dict[str, str]:
    """mtcore name -> HF name of every one-to-one tensor (qkv is fused: see _QKV)."""
    names = dict(_OUTSIDE, **(_PAIR if config.pair_head else {}))
    for i in range(config.num_layers):
        for mine, theirs in _LAYER.items():
            for kind in ("weight", "bias"):
                names[f"layers.{i}.{mine}.{kind}"] = f"bert.encoder.layer.{i}.{theirs}.{kind}"
    return names


# -- config ----------------------------------------------------------------------------
def bert_config(config: BertConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json of ``config`` as a HuggingFace BertForPreTraining (BertForMaskedLM
    without a pair head)."""
    if config.vocab_size is None:
        raise HFInteropError("model.vocab_size is unset: fill it in with config.with_vocab(...)")
    if not config.bias:
        raise HFInteropError(
            "bias=False cannot be exported: HuggingFace BERT's linears have biases"
        )
    return {
        "architectures": ["BertForPreTraining" if config.pair_head else "BertForMaskedLM"],
        "model_type": "bert",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "intermediate_size": config.ffn_size,
        "hidden_act": "gelu",
        "hidden_dropout_prob": config.dropout,
        "attention_probs_dropout_prob": config.attention_dropout,
        "max_position_embeddings": config.seq_len,
        "type_vocab_size": config.type_vocab_size,
        "initializer_range": config.init_std,
        "layer_norm_eps": config.norm_eps,
        "position_embedding_type": "absolute",
        "is_decoder": False,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "torch_dtype": DTYPE_NAMES[dtype],
    }


def model_config_from_bert(
    hf: dict, seq_len: int | None = None, pair_head: bool = True
) -> BertConfig:
    """The mtcore BertConfig of a HuggingFace BERT config.json (a dict). ``seq_len``: the
    positions kept (at most ``max_position_embeddings``; None: all of them)."""
    _check_importable(hf)
    positions = need(hf, "max_position_embeddings")
    if seq_len is not None and seq_len > positions:
        raise HFInteropError(
            f"seq_len={seq_len} exceeds max_position_embeddings={positions}: the position "
            "table has no rows for the extra positions"
        )
    try:
        return BertConfig(
            vocab_size=need(hf, "vocab_size"),
            hidden_size=need(hf, "hidden_size"),
            num_layers=need(hf, "num_hidden_layers"),
            num_heads=need(hf, "num_attention_heads"),
            ffn_hidden_size=need(hf, "intermediate_size"),
            seq_len=seq_len or positions,
            type_vocab_size=hf.get("type_vocab_size", 2),
            norm_eps=hf.get("layer_norm_eps", 1e-12),
            dropout=hf.get("hidden_dropout_prob", 0.1),
            attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
            init_std=hf.get("initializer_range") or 0.02,
            pair_task="nsp" if pair_head else "none",
        )
    except ValidationError as e:
        raise HFInteropError(f"the BERT config does not make an mtcore model: {e}") from e


def _check_importable(hf: dict) -> None:
    check_model_type(hf, "bert", "BERT", "BERT")
    if hf.get("hidden_act", "gelu") != "gelu":
        raise HFInteropError(
            f"hidden_act={hf['hidden_act']!r}: mtcore's BERT uses the exact (erf) GELU, 'gelu'"
        )
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise HFInteropError(
            f"position_embedding_type={hf['position_embedding_type']!r}: mtcore's BERT has "
            "absolute (learned) position embeddings only"
        )
    for key in ("is_decoder", "add_cross_attention"):
        if hf.get(key):
            raise HFInteropError(
                f"{key}=true: mtcore's BERT is an encoder, without cross-attention"
            )
    if not hf.get("tie_word_embeddings", True):
        raise HFInteropError(
            "tie_word_embeddings=false: mtcore's MLM decoder is the word embedding"
        )


# -- weights ---------------------------------------------------------------------------
def to_bert_tensors(config: BertConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """HuggingFace BERT tensors (names, q/k/v unfused) from mtcore full weights. The tied
    decoder weight is left out, as ``save_pretrained`` does."""
    bert_config(config)  # refuses what cannot be exported
    check_full_weights(config, weights, "the weights to export")
    out = {theirs: weights[mine] for mine, theirs in _names(config).items()}
    h = config.hidden_size
    for i in range(config.num_layers):
        for kind in ("weight", "bias"):
            parts = weights[f"layers.{i}.attn.qkv.{kind}"].split(h, dim=0)
            for theirs, part in zip(_QKV, parts, strict=True):
                out[f"bert.encoder.layer.{i}.{theirs}.{kind}"] = part
    return out


def from_bert_tensors(config: BertConfig, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """mtcore full weights (fp32) from HuggingFace BERT tensors; refuses missing,
    unexpected or misshapen tensors, naming them."""
    tensors = {_current_name(name): tensor for name, tensor in tensors.items()}
    if "cls.predictions.bias" not in tensors and "cls.predictions.decoder.bias" in tensors:
        tensors = {**tensors, "cls.predictions.bias": tensors["cls.predictions.decoder.bias"]}
    source = TensorTaker(tensors)
    weights = {mine: source.take(theirs) for mine, theirs in _names(config).items()}
    weights["embed.position"] = weights["embed.position"][: config.seq_len]
    for i in range(config.num_layers):
        for kind in ("weight", "bias"):
            parts = [source.take(f"bert.encoder.layer.{i}.{theirs}.{kind}") for theirs in _QKV]
            weights[f"layers.{i}.attn.qkv.{kind}"] = torch.cat(parts, dim=0)
    for copy, twin in (
        ("cls.predictions.decoder.weight", "embed.word.weight"),
        ("cls.predictions.decoder.bias", "mlm.bias"),
    ):
        if copy in source and not torch.equal(source.take(copy), weights[twin]):
            raise HFInteropError(
                f"{copy} differs from the tensor it is tied to; cannot map an untied decoder"
            )
    # Old checkpoints carry the position ids as a buffer; mtcore makes none.
    source.refuse_untaken("mtcore's BERT", ignored_suffix="embeddings.position_ids")
    with as_interop_error():
        check_full_weights(config, weights, "the imported tensors")
    return weights


def _current_name(name: str) -> str:
    """The original TensorFlow conversions (bert-base-uncased and kin) call LayerNorm
    parameters gamma and beta; transformers renames them on load, and so does this."""
    for old, new in (("LayerNorm.gamma", "LayerNorm.weight"), ("LayerNorm.beta", "LayerNorm.bias")):
        if name.endswith(old):
            return name[: -len(old)] + new
    return name


# -- directories -----------------------------------------------------------------------
def import_bert(
    hf_dir: str | Path, seq_len: int | None = None
) -> tuple[BertConfig, dict[str, Tensor]]:
    """The BertConfig and fp32 full weights (``Bert(config).state_dict()`` names) of a
    HuggingFace BERT directory; the pair head is there if ``cls.seq_relationship`` is."""
    directory = Path(hf_dir)
    hf = read_config(directory)
    _check_importable(hf)
    tensors = read_safetensors(directory)
    pair_head = "cls.seq_relationship.weight" in tensors
    config = model_config_from_bert(hf, seq_len, pair_head)
    return config, from_bert_tensors(config, tensors)


def export_bert(
    model_config: BertConfig,
    full_weights: dict[str, Tensor],
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    tokenizer_json: str | Path | None = None,
) -> Path:
    """Write a HuggingFace BERT directory (config.json, model.safetensors and, when given,
    tokenizer.json with a tokenizer_config.json) that ``BertForPreTraining`` (or
    ``BertForMaskedLM``) ``.from_pretrained`` loads. Returns ``out_dir``."""
    if dtype not in DTYPE_NAMES:
        raise HFInteropError(f"dtype {dtype} is not one of {list(DTYPE_NAMES.values())}")
    config = bert_config(model_config, dtype)
    tensors = to_bert_tensors(model_config, full_weights)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_json is not None:
        special = _special_tokens(Path(tokenizer_json))
        copy_tokenizer(
            out,
            tokenizer_json,
            model_config.seq_len,
            # A plain fast tokenizer returns no token types unless told: pairs would read
            # as one segment.
            model_input_names=["input_ids", "token_type_ids", "attention_mask"],
            **{role: token for role, (token, _) in special.items()},
        )
        if "pad_token" in special:
            config["pad_token_id"] = special["pad_token"][1]
    write_weights_and_config(out, config, tensors, dtype)
    return out


def _special_tokens(path: Path) -> dict[str, tuple[str, int]]:
    """role -> (token, id) of the BERT special tokens a tokenizer.json has."""
    data = read_tokenizer(path)
    ids = added_token_ids(data)
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):  # WordPiece / BPE keep special tokens in the vocab too
        ids = {**{k: v for k, v in vocab.items() if k in sum(_SPECIAL.values(), ())}, **ids}
    found = {}
    for role, spellings in _SPECIAL.items():
        token = next((t for t in spellings if ids.get(t) is not None), None)
        if token is not None:
            found[role] = (token, ids[token])
    return found
