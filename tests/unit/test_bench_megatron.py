"""benchmarks/bench_megatron.py and its package benchmarks/against_megatron/, without
ranks or Megatron-Core: the command line keeps its default configurations, every
configuration is a layout mtcore accepts for its model, both sides get the same
batches, and the CPU stand-ins for Megatron's CUDA calls do what they say.
(tests/distributed/test_bench_megatron_runs.py runs one step of each new configuration.)"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_megatron
from against_megatron import configs
from against_megatron.cpu_shims import _CpuTorch, _split_sizes_on_host
from against_megatron.mtcore_side import family_config

from mtcore.distributed import LayoutSpec

NEW = ("pp2", "pp2-tp2", "moe-ep2", "bert-tp2", "t5-tp2", "dp2-distopt")


def test_the_command_line_keeps_its_defaults_and_takes_the_new_configurations():
    args = bench_megatron.parse_args([])
    assert args.configs == ["tp1", "tp2", "tp2-sp", "llama-tp2"]
    assert bench_megatron.parse_args(["--configs", *NEW]).configs == list(NEW)
    with pytest.raises(SystemExit):
        bench_megatron.parse_args(["--configs", "pp4"])


@pytest.mark.parametrize("name", list(configs.CONFIGS))
def test_each_configuration_is_a_layout_mtcore_takes_for_its_model(name):
    cfg = configs.CONFIGS[name]
    spec = LayoutSpec(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, ep=cfg.ep, sequence_parallel=cfg.sp)
    assert spec.resolve(cfg.world).dp == cfg.dp
    model = family_config(cfg)
    assert (model.family, model.hidden_size, model.num_heads) == (
        cfg.family, configs.HIDDEN, configs.HEADS,
    )  # fmt: skip
    assert model.num_layers == configs.LAYERS  # T5: 2 encoder + 2 decoder layers
    assert cfg.micro_batch * cfg.microbatches == configs.BATCH
    assert cfg.microbatches >= cfg.pp  # 1F1B needs a micro-batch per stage at least
    if cfg.experts:
        assert (model.moe.num_experts, model.moe.top_k, model.moe.dispatcher) == (8, 2, "alltoall")


@pytest.mark.parametrize("name", ["pp2", "bert-tp2", "t5-tp2", "dp2-distopt"])
def test_the_batches_are_the_same_on_every_call_and_split_over_data_replicas(name):
    cfg = configs.CONFIGS[name]
    first = configs.step_batches(cfg, 2, dp_rank=0)
    again = configs.step_batches(cfg, 2, dp_rank=0)
    assert len(first) == 2 and len(first[0]) == cfg.microbatches
    for a, b in zip(first[0], again[0], strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tokens = first[0][0]["tokens"]
    assert tokens.shape == (cfg.micro_batch, configs.SEQ)
    if cfg.family == "bert":
        masked = first[0][0]["labels"] != configs.IGNORE_INDEX
        assert 0.05 < masked.float().mean() < 0.3
        assert (tokens[masked] == configs.MASK_ID).all()
    if cfg.family == "t5":
        assert first[0][0]["decoder_tokens"].shape == (cfg.micro_batch, configs.DECODER_SEQ)
    if cfg.dp > 1:
        other = configs.step_batches(cfg, 2, dp_rank=1)
        assert not torch.equal(tokens, other[0][0]["tokens"])


def test_the_cpu_stand_ins_put_cuda_tensors_on_the_host():
    cpu_torch = _CpuTorch()
    assert cpu_torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert cpu_torch.tensor([1.0], device="cuda").device.type == "cpu"
    assert cpu_torch.arange is torch.arange
    stream = cpu_torch.cuda.Stream()
    with cpu_torch.cuda.stream(stream):
        stream.wait_stream(cpu_torch.cuda.current_stream())
    stream.record_event().synchronize()
    sizes = _split_sizes_on_host(torch.tensor([3, 5]), as_numpy=True)
    assert isinstance(sizes, np.ndarray) and sizes.tolist() == [3, 5]


def test_the_gemm_floor_replays_every_profiled_product_and_the_op_table_names_them():
    from against_megatron.op_profile import gemm_floor, op_table, op_times, profile_side

    a, b, bias = torch.randn(64, 32), torch.randn(32, 48), torch.randn(48)
    batches = [0, 1]

    def step(_):
        (a @ b).relu()  # aten::mm, once a step
        torch.addmm(bias, a, b)  # aten::addmm
        torch.bmm(a.expand(3, 64, 32), b.expand(3, 32, 48))  # aten::bmm, 3 products

    prof = profile_side(step, batches, record_shapes=True)
    floor = gemm_floor(prof, len(batches), reps=2)
    assert floor["shapes"] == 3 and floor["unreplayed"] == 0
    assert floor["flops"] == 2.0 * 64 * 32 * 48 * (1 + 1 + 3)
    assert 0 < floor["seconds"] < 1
    names = [name for name, _, _ in op_table(prof, len(batches), 20)]
    assert {"aten::mm", "aten::addmm", "aten::bmm", "aten::relu"} <= set(names)
    calls = {name: per_step for name, _, per_step in op_table(prof, len(batches), 20)}
    assert calls["aten::mm"] == 1
    assert op_times(prof, len(batches))["matmul"] > 0
