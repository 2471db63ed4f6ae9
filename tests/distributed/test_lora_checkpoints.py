"""LoRA checkpoints: the adapters alone with a reference to the base, exact resume, and
loading under another layout (the real trainer loop on 4 gloo ranks).

A full-model job (tp2) writes the base; a LoRA job (tp2 x pp2) starts from it
(``checkpoint.load``), saves at step 3 and 6; its step-3 checkpoint resumes bitwise
under tp2 x pp2 and continues under dp4 within ``RESHARD_RTOL``. The LoRA checkpoint
holds no frozen weight (its model tensors are a seventh of the base's here), and its manifest names
the base's directory, step and manifest checksum. In one process it loads onto the base
as saved, a full model refuses it, and ``read_model_weights`` gives the base with the
adapters merged into the adapted linears only.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.models import LoRAConfig, is_adapter
from mtcore.parallel.layout import ParallelLayout
from mtcore.testing.distributed import run_ranks
from mtcore.training.checkpoint import Checkpointer, CheckpointError, read_model_weights
from mtcore.training.checkpoint.lora_weights import read_lora_weights
from mtcore.training.checkpoint.manifest import MANIFEST, sha256_file
from mtcore.training.checkpoint.safe_reader import tensor_shapes
from mtcore.training.engine import Engine
from tests.distributed import test_checkpoint_layouts as layouts

job = layouts.job  # the fixture: a corpus and the job configs
LORA = {"rank": 4, "alpha": 8.0, "targets": ["q", "k", "v", "o", "fc1", "fc2"]}


def _model_elements(directory) -> int:
    """Elements of the model's tensors in a checkpoint (the files also hold RNG states
    and DCP's metadata, which dominate at this toy size)."""
    return sum(
        math.prod(shape)
        for key, (shape, _) in tensor_shapes(directory).items()
        if key.startswith("model.")
    )


def test_lora_checkpoint_holds_adapters_resumes_bitwise_and_reshards(job):
    root, make = job
    base = root / "base" / "checkpoints" / "step_000006"
    tp_pp, source = {"tp": 2, "pp": 2}, root / "lora" / "checkpoints"

    def lora(name: str, parallel: dict, load) -> dict:
        data = make(name, parallel, load=str(load))
        return {**data, "finetune": {"lora": LORA}}

    jobs = [
        make("base", {"tp": 2}),
        lora("lora", tp_pp, base),
        lora("lora_resumed", tp_pp, source / "step_000003"),
        lora("lora_dp4", {"dp": 4}, source / "step_000003"),
    ]
    results = run_ranks(layouts._run_jobs, 4, jobs)[0]
    (base_losses, _, _), (whole, start, log), resumed, dp4 = results

    assert start == 0 and f"model weights from {base}" in log, log
    assert "lora: rank 4, alpha 8, dropout 0 on q, k, v, o, fc1, fc2 | rank 0 trains 0.003M" in log, log
    assert whole[0] < base_losses[0], (whole, base_losses)  # it starts from the trained base
    assert resumed[1] == 3 and "RNG streams restored" in resumed[2], resumed[2]
    assert resumed[0] == whole[3:]  # bitwise: adapters, their optimizer state, data position
    layouts._check_reshard(whole, dp4, "lora tp2 x pp2 -> dp4")

    saved = source / "step_000003"
    keys = set(tensor_shapes(saved))
    models = sorted(k for k in keys if k.startswith("model."))
    assert models and all(".lora." in k for k in models), models  # no frozen weight
    assert (
        "model.layers.0.attn.qkv.lora.q.A" in keys
        and "optim.exp_avg.layers.3.mlp.fc2.lora.fc2.B" in keys
    )
    assert not any(k.startswith("optim.") and ".lora." not in k for k in keys)
    # rank 4 on every linear of a 32-wide model: 8192 adapter elements of the base's 56k
    assert _model_elements(saved) == 8192 and _model_elements(base) > 6 * 8192
    manifest = json.loads((saved / MANIFEST).read_text())
    assert manifest["lora"]["config"]["rank"] == 4
    assert manifest["lora"]["base"] == {
        "path": str(base.resolve()),
        "step": 6,
        "manifest_sha256": sha256_file(base / MANIFEST),
    }

    # In one process: the adapters load as saved, onto the base as saved; a full model
    # refuses them; reading the checkpoint whole gives the base with the adapters merged.
    config, lora, adapters, base_weights = read_lora_weights(saved)
    assert lora == LoRAConfig(**LORA) and set(adapters) == {
        m.removeprefix("model.") for m in models
    }
    assert base_weights.keys() == read_model_weights(base)[1].keys()

    def engine(lora_config):
        return Engine(config, ParallelLayout.single(), select_backend("cpu"), micro_batch_size=2,
                      num_microbatches=1, lora=lora_config)  # fmt: skip

    one = engine(lora)
    loaded = Checkpointer(one).load(saved)
    assert loaded.step == 3 and loaded.resharded is not None
    weights = one.full_state_dict()
    assert all(torch.equal(weights[n], t) for n, t in adapters.items())
    assert all(torch.equal(weights[n], t) for n, t in base_weights.items())
    with pytest.raises(CheckpointError, match="holds LoRA adapters only"):
        Checkpointer(engine(None)).load(saved)
    merged = read_model_weights(saved)[1]
    assert merged.keys() == base_weights.keys() and not any(is_adapter(n) for n in merged)
    changed = [n for n in merged if not torch.equal(merged[n], base_weights[n])]
    assert "layers.0.attn.qkv.weight" in changed and "layers.3.mlp.fc2.weight" in changed
    assert not any("norm" in n or "embed" in n for n in changed)
