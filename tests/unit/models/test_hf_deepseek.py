"""DeepSeek-V2 and -V3 interop in one process, against transformers itself (random tiny
models, fp32).

Two V3 variants: compressed queries with YaRN scaling (softmax mscale), and a plain query
projection with plain RoPE; both with a dense first layer, shared and group-limited
sigmoid-routed experts, a nonzero aux-loss-free bias and a routed scale. Two V2 ones, with
softmax-routed experts (greedy, and group-limited keeping every group) and a routed
scale: V2-Lite's plain query projection, and compressed queries with YaRN. Each imports
with transformers' logits, generates greedily as transformers does (both cache the
compressed latent), exports to a directory transformers loads
with no missing or unexpected keys and the same logits, and imports again bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.models.common.latent_spec import MLASpec, softmax_scale
from mtcore.models.common.sampling import continue_tokens
from mtcore.models.gpt import GPT, GPTConfig, single_context
from mtcore.models.gpt.hf import HFInteropError, export_hf, import_hf, model_config_from_hf
from mtcore.parallel.tensor.weight_grad import WeightGradStore, deferring_weight_grads

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

VOCAB, SEQ = 96, 24
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=80,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=2,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    max_position_embeddings=SEQ,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=8,
    beta_fast=32,
    beta_slow=1,
    mscale=0.707,
    mscale_all_dim=0.707,
)
CASES = {
    "q_lora_yarn": dict(q_lora_rank=24, rope_parameters=YARN),
    "plain_q": dict(q_lora_rank=None),
    "v2_lite": dict(version="V2", q_lora_rank=None, topk_method="greedy"),
    "v2_q_lora_yarn": dict(
        version="V2",
        q_lora_rank=24,
        rope_parameters=YARN,
        topk_method="group_limited_greedy",
        topk_group=4,
    ),
}


def hf_deepseek(seed: int, version: str = "V3", **changes):
    config = getattr(transformers, f"Deepseek{version}Config")(**{**SIZES, **changes})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, f"Deepseek{version}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
        for layer in model.model.layers[1:] if version == "V3" else []:  # a trained bias
            layer.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(8))
    return model


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens())
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{case: (directory, transformers model)}."""
    out = {}
    for seed, (name, changes) in enumerate(CASES.items()):
        model = hf_deepseek(seed, **changes)
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory)
        out[name] = (directory, model)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_imports_with_transformers_logits_generation_and_exports_back(
    saved, case, tmp_path
):
    directory, hf = saved[case]
    expected = logits_of(hf)
    config, weights = import_hf(directory)
    model = GPT(config, single_context(config, select_backend("cpu"))).eval()
    model.load_state_dict(weights)
    got = logits_of(model)
    assert (got - expected).abs().max() < 1e-4
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    prompt = tokens(2)[:, :6]
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(model.generate(prompt, 10), want)

    out = export_hf(config, weights, tmp_path / "hf")
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager"
    )
    assert not {k: v for k, v in info.items() if v}
    assert type(back) is type(hf)
    torch.testing.assert_close(logits_of(back.eval()), expected, atol=1e-5, rtol=1e-5)
    config_back, weights_back = import_hf(out)
    assert config_back == config
    assert all(torch.equal(weights_back[k], weights[k]) for k in weights)


def test_what_a_deepseek_import_becomes(saved):
    config, weights = import_hf(saved["q_lora_yarn"][0])
    assert config.mla.q_lora_rank == 24 and config.mla.qk_head_dim == 16
    assert config.first_dense_layers == 1 and not config.is_moe_layer(0)
    m = config.moe
    assert (m.num_experts, m.top_k, m.shared_ffn_size, m.score) == (8, 3, 32, "sigmoid")
    assert (m.expert_groups, m.top_groups, m.routed_scale) == (4, 2, 2.5)
    assert m.bias_update_rate > 0  # the imported bias steers the choice
    assert weights["layers.0.mlp.fc1.weight"].shape == (160, 48)  # dense: 2 x 80
    assert weights["layers.1.attn.kv_up.weight"].shape == (4 * (8 + 12), 16)
    # YaRN's mscale: (0.1 * 0.707 * ln 4 + 1)^2 / sqrt(16)
    assert softmax_scale(config.mla, config.rope_scaling) == pytest.approx(
        (0.1 * 0.707 * torch.log(torch.tensor(4.0)).item() + 1) ** 2 / 4
    )
    plain, _ = import_hf(saved["plain_q"][0])
    assert plain.mla.q_lora_rank is None and plain.rope_scaling is None


def test_what_a_deepseek_v2_import_becomes(saved):
    config, _ = import_hf(saved["v2_lite"][0])
    m = config.moe
    assert (m.score, m.norm_topk, m.topk_then_softmax, m.bias_update_rate) == (
        "softmax",
        False,
        False,
        0.0,
    )
    assert (m.expert_groups, m.routed_scale, m.aux_loss, m.aux_loss_coeff) == (1, 2.5, "seq", 1e-3)
    assert config.mla.q_lora_rank is None and config.first_dense_layers == 1


def test_deepseek_v2_import_refuses_what_mtcore_routes_otherwise(saved):
    hf = transformers.AutoConfig.from_pretrained(saved["v2_lite"][0]).to_dict()
    cases = [
        (
            dict(topk_method="group_limited_greedy", n_group=4, topk_group=2),
            r"topk_method='group_limited_greedy' with topk_group=2 < n_group=4",
        ),
        (dict(topk_method="noaux_tc"), r"topk_method='noaux_tc'"),
        (dict(norm_topk_prob=True), r"norm_topk_prob=true"),
        (dict(moe_layer_freq=2), r"moe_layer_freq=2"),
    ]
    for changes, message in cases:
        with pytest.raises(HFInteropError, match=message):
            model_config_from_hf({**hf, **changes})


MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


def test_export_refuses_what_deepseek_cannot_hold(tmp_path):
    moe = dict(num_experts=4, top_k=2, ffn_size=16, score="sigmoid")
    base = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, seq_len=SEQ)
    softmax = {**moe, "score": "softmax", "norm_topk": False}
    cases = [
        (dict(mla=MLA, moe={**moe, "score": "softmax"}), "v3", r"moe\.score='softmax'"),
        (dict(mla=MLA, moe={**moe, "shared_ffn_size": 24}), "v3", r"not a multiple of moe\.ffn"),
        (dict(mla=MLA, moe=moe, moe_layer_freq=2), "v3", r"dense layers between MoE layers"),
        (dict(moe=moe), "v3", r"grouped-query attention"),
        (dict(mla=MLA, moe=moe), "v2", r"V2 cannot hold moe\.score='sigmoid'"),
        (dict(mla=MLA, moe={**softmax, "norm_topk": True}), "v2", r"moe\.norm_topk \("),
        (
            dict(mla=MLA, moe={**softmax, "expert_groups": 2, "top_groups": 1}),
            "v2",
            r"moe\.top_groups=1 < moe\.expert_groups=2",
        ),
        (dict(mla=MLA, moe={**softmax, "topk_then_softmax": True}), "v2", r"topk_then_softmax"),
    ]
    for fields, version, message in cases:
        config = GPTConfig(**base, **fields)
        weights = GPT(config, single_context(config, select_backend("cpu"))).state_dict()
        with pytest.raises(HFInteropError, match=message):
            export_hf(config, weights, tmp_path, architecture=f"deepseek_{version}")
    config = GPTConfig(**base, mla=MLA)
    weights = GPT(config, single_context(config, select_backend("cpu"))).state_dict()
    with pytest.raises(HFInteropError, match=r"latent attention .* cannot be exported as Llama"):
        export_hf(config, weights, tmp_path, architecture="llama")
    assert not list(tmp_path.iterdir())


def test_mla_spec_counts_and_cache():
    spec = MLASpec(**MLA, q_lora_rank=12)
    config = GPTConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, mla=spec)
    model = GPT(config, single_context(config, select_backend("cpu")))
    assert sum(p.numel() for p in model.parameters()) == config.num_params()
    assert spec.cache_values_per_token() == 16 + 8  # latent + shared rope key
    with pytest.raises(ValueError, match="needs position='rope'"):
        GPTConfig(vocab_size=VOCAB, style="gpt2", mla=MLA)
    for refused in (dict(attention_dropout=0.1), dict(sliding_window=8, seq_len=16)):
        with pytest.raises(ValueError, match="mla has no attention_dropout nor a sliding_window"):
            GPTConfig(vocab_size=VOCAB, mla=MLA, **refused)
    GPTConfig(vocab_size=VOCAB, mla=MLA, sliding_window=16, seq_len=16)  # hides nothing


def test_generation_caches_only_the_compressed_latent(saved):
    """Generation keeps, per layer and token, the latent and the shared rope key
    (16 + 8 numbers here) instead of every head's key and value (4 x (16 + 12) = 112),
    and generates what the uncached window loop generates."""
    config, weights = import_hf(saved["q_lora_yarn"][0])
    model = GPT(config, single_context(config, select_backend("cpu"))).eval()
    model.load_state_dict(weights)
    prompt = tokens(3)[:, :5]
    cached = model.generate(prompt, 8)
    assert torch.equal(cached, continue_tokens(model, prompt, 8, config.seq_len))
    assert torch.equal(cached, model.generate(prompt, 8, use_cache=False))
    caches = [{} for _ in model.layers]  # the per-layer cache generate() grows
    first = model.cached_logits(cached[:, :-4], caches, offset=0)
    rest = model.cached_logits(cached[:, -4:-1], caches, offset=cached.shape[1] - 4)
    whole = model(cached[:, :-1])
    torch.testing.assert_close(torch.cat([first, rest], 1), whole, rtol=1e-5, atol=1e-5)
    assert all(sorted(cache) == ["k_rope", "latent"] for cache in caches)
    assert all(cache["latent"].shape[1] == 5 + 8 - 1 for cache in caches)
    per_token = config.mla.cache_values_per_token()
    assert per_token == 24
    assert caches[1]["latent"].numel() + caches[1]["k_rope"].numel() == 2 * 12 * per_token
    mha = config.num_heads * (config.mla.qk_head_dim + config.mla.v_head_dim)
    assert mha / per_token > 4.6


def test_mla_defers_every_projection_weight_gradient_under_zero_bubble():
    """Inside ``deferring_weight_grads`` (a zero-bubble B pass) every projection of
    latent attention, the replicated down-projections too, leaves its weight gradient
    to W, and W's products equal the unsplit backward's bitwise."""
    config = GPTConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=4, mla={**MLA, "q_lora_rank": 12}
    )
    plain = GPT(config, single_context(config, select_backend("cpu")))
    split = GPT(config, single_context(config, select_backend("cpu")))
    batch = tokens(4)[:, :8]
    plain(batch, batch).backward()
    store = WeightGradStore()
    with deferring_weight_grads(store):
        loss = split(batch, batch)
    loss.backward()
    names = {"q_down", "q_up", "kv_down", "kv_up", "proj"}
    deferred = {n for n, p in split.layers["0"].attn.named_parameters() if p.grad is None}
    assert deferred == {f"{n}.weight" for n in names}
    for weight, grad in store.compute():
        weight.grad = grad
    for (name, got), want in zip(split.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(got.grad, want.grad), name


def test_only_the_mtp_layers_the_config_declares_are_skipped(saved, tmp_path):
    """DeepSeek-V3 checkpoints carry ``num_nextn_predict_layers`` multi-token-prediction
    layers after the last one: skipped. Any other layer past the last is refused, for
    every decoder (it was dropped without a word)."""
    import json

    from safetensors.torch import load_file, save_file

    source = saved["plain_q"][0]
    tensors = load_file(source / "model.safetensors")
    last = SIZES["num_hidden_layers"] - 1
    mtp = {k.replace(f"layers.{last}.", "layers.3.", 1): v.clone()
           for k, v in tensors.items() if k.startswith(f"model.layers.{last}.")}  # fmt: skip

    def variant(name, extra, declared):
        directory = tmp_path / name
        directory.mkdir()
        config = json.loads((source / "config.json").read_text())
        config["num_nextn_predict_layers"] = declared
        (directory / "config.json").write_text(json.dumps(config))
        save_file({**tensors, **extra}, directory / "model.safetensors")
        return directory

    config, weights = import_hf(variant("declared", mtp, 1))
    assert config.num_layers == 3 and not any(k.startswith("layers.3.") for k in weights)
    with pytest.raises(HFInteropError, match=r"layer\(s\) 3 past the 3 layers"):
        import_hf(variant("undeclared", mtp, 0))
    beyond = {k.replace("layers.3.", "layers.4.", 1): v.clone() for k, v in mtp.items()}
    with pytest.raises(HFInteropError, match=r"layer\(s\) 4 past the 3 layers .* and 1 "):
        import_hf(variant("past_the_mtp", {**mtp, **beyond}, 1))
