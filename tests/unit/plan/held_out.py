"""Published training runs the planner was not tuned on, each with its real layout.

Every row names its source and says what was assumed where the source is silent. The
rule for an unpublished recompute setting: the lightest (none, selective, full) under
which the published layout fits the accelerator's memory (the run did train), chosen
before comparing throughput. ``metric``: ``tflops`` counts recompute (Narayanan et al.'s
count, what Megatron-style logs print), ``model_tflops`` does not (MFU's), ``tokens``
is tokens/s per accelerator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from mtcore.plan import Hardware, Options, load_hardware

MEGATRON_DEEPSPEED = Options(dp_overlap="none", fused_attention=False)
"""Megatron-DeepSpeed in 2021-22 (MT-NLG, BLOOM): scores materialised, the dp reduction
after backward, gradients accumulated and reduced in fp32 (DeepSpeed's bf16 optimizer)."""
MEGATRON_CORE = Options(dp_overlap="full", fused_attention=True, overlapped=("tp", "pp"))
FSDP2 = Options(zero=3, dp_overlap="full", fused_attention=True)
"""torchtitan's FSDP2: parameters resharded after forward, gradients reduced in fp32."""


@dataclass(frozen=True)
class Row:
    name: str
    source: str
    gpus: int
    hardware: Callable[[], Hardware]
    model: dict
    parallel: dict
    dtype: str
    global_batch: int
    micro_batch: int
    options: Options
    published: float
    metric: str
    missed: str = ""

    def config(self):
        from mtcore.training.config import TrainConfig

        return TrainConfig.model_validate(
            {
                "model": {"family": "gpt", **self.model},
                "parallel": self.parallel,
                "precision": {"dtype": self.dtype},
                "training": {
                    "global_batch_size": self.global_batch,
                    "micro_batch_size": self.micro_batch,
                },
            }
        )

    def predicted(self, result) -> float:
        return {
            "tflops": result.tflops_per_gpu,
            "model_tflops": result.model_tflops_per_gpu,
            "tokens": result.tokens_per_s / result.gpus,
        }[self.metric]


def a100() -> Hardware:
    return load_hardware("A100-80GB")


def jean_zay() -> Hardware:
    """BLOOM's Jean Zay nodes: 8 x A100 80GB, four 100 Gb/s Omni-Path links a node
    (BLOOM paper, sec. 3.4.1): 50 GB/s a node, 6.25 GB/s per accelerator."""
    return replace(a100(), name="A100-80GB (Jean Zay)", inter_node_gbs=6.25)


def meta_roce() -> Hardware:
    """Llama 3's H100 cluster (Llama 3 paper, sec. 3.3.1): 400 Gb/s per GPU; pods of 3,072
    GPUs (384 nodes) at full bisection; above the pods a 1:7 oversubscribed layer."""
    return replace(
        load_hardware("H100-SXM"),
        name="H100-SXM (Meta RoCE)",
        nodes_per_pod=384,
        inter_pod_gbs=50.0 / 7,
    )


def grand_teton() -> Hardware:
    """torchtitan's benchmark hosts (its docs/performance.md): H100 with 96 GB of HBM2e
    at 2.4 TB/s, 400 Gb/s per GPU, run at a 500 W power limit (not modelled)."""
    return replace(
        load_hardware("H100-SXM"),
        name="H100 96GB (Grand Teton)",
        memory_gb=96 * 1.073741824,
        memory_bandwidth_gbs=2400.0,
    )


def _gpt3(hidden, layers, heads, vocab, dropout=0.1):
    return dict(style="gpt2", hidden_size=hidden, num_layers=layers, num_heads=heads,
                seq_len=2048, vocab_size=vocab, dropout=dropout, recompute="full")  # fmt: skip


def _llama(hidden, layers, heads, ffn, recompute):
    return dict(style="llama", hidden_size=hidden, num_layers=layers, num_heads=heads,
                num_kv_heads=8, ffn_hidden_size=ffn, seq_len=8192, vocab_size=128256,
                recompute=recompute)  # fmt: skip


_MTNLG = (
    "Smith et al. 2022 (arXiv 2201.11990) sec. 2.4: 530B, tp 8 x pp 35, batch 1920, "
    "60.1 / 50.2 / 44.4 s an iteration on 280 / 350 / 420 DGX A100 nodes"
)
_MTNLG_MISS = (
    "DeepSpeed's pipeline engine: Narayanan et al. ran the same 530B model, tp 8 x pp 35, "
    "at 163 TFLOP/s on 2520 A100s with Megatron-LM (a row this planner lands)"
)
_LLAMA3 = (
    "Llama 3 paper (arXiv 2407.21783) Table 4 and sec. 3.3.2: 405B, tp 8 x pp 16, 16M "
    "tokens a step, one layer fewer on the first and last stage, the first chunk holding "
    "only the embedding (so 8 chunks a stage); FSDP under pipelining gathers once and "
    "reduces once a step (ZeRO-1's traffic)"
)
LLAMA3_LAYOUT = {"tp": 8, "pp": 16, "vpp": 8, "sequence_parallel": True, "zero1": True,
                 "first_stage_layers": 7, "last_stage_layers": 7}  # fmt: skip
_TITAN = "torchtitan docs/performance.md"

HELD_OUT = [
    *(
        Row(
            f"MT-NLG 530B, {gpus} A100",
            _MTNLG,
            gpus,
            a100,
            _gpt3(20480, 105, 128, 51200),
            {"tp": 8, "pp": 35},
            "bf16",
            1920,
            1,
            MEGATRON_DEEPSPEED,
            published,
            "tflops",
            _MTNLG_MISS,
        )
        for gpus, published in ((2240, 126.0), (2800, 121.0), (3360, 113.0))
    ),
    Row(
        "BLOOM 176B, 384 A100",
        "BLOOM paper (arXiv 2211.05100) sec. 3.4 and the BigScience model page: tp 4 x pp 12 "
        "x dp 8, ZeRO-1, batch 2048 in micro-batches of 2, about 150 TFLOP/s; 70 layers "
        "on 12 stages as 5 + 10 x 6 + 5 (Megatron-DeepSpeed counts the embedding as a layer)",
        384,
        jean_zay,
        _gpt3(14336, 70, 112, 250880, dropout=0.0),
        {"tp": 4, "pp": 12, "zero1": True, "first_stage_layers": 5, "last_stage_layers": 5},
        "bf16",
        2048,
        2,
        MEGATRON_DEEPSPEED,
        150.0,
        "tflops",
        "Megatron-DeepSpeed's pipeline engine, as MT-NLG's rows",
    ),
    Row(
        "OPT-175B, 992 A100",
        "OPT paper (arXiv 2205.01068) sec. 2.4: 992 A100 80GB, FSDP with Megatron tp 8, "
        "up to 147 TFLOP/s; metaseq's opt_baselines.py: --no-reshard-after-forward (ZeRO-2), "
        "--memory-efficient-fp16 (fp16 gradients reduced), --checkpoint-activations, "
        "update-freq 1 (the 8 sequences a rank in one micro-batch), 2M-token batches",
        992,
        a100,
        _gpt3(12288, 96, 96, 50272),
        {"tp": 8},
        "fp16",
        992,
        8,
        replace(MEGATRON_DEEPSPEED, zero=2, dp_overlap="full", grad_reduce_dtype="fp16"),
        147.0,
        "tflops",
        "metaseq's kernels and its 'up to' figure; and it does not fit as planned: the "
        "planner has no --distribute-checkpointed-activations (the kept layer inputs, "
        "39 GB here, split over tp)",
    ),
    *(
        Row(
            f"Llama 3 405B, {gpus} H100",
            _LLAMA3,
            gpus,
            meta_roce,
            _llama(16384, 126, 128, 53248, "full"),
            LLAMA3_LAYOUT,
            "bf16",
            2048,
            1,
            MEGATRON_CORE,
            published,
            "model_tflops",
        )
        for gpus, published in ((8192, 430.0), (16384, 400.0))
    ),
    Row(
        "torchtitan Llama 3 8B, 64 A100",
        f"{_TITAN}: FSDP2 on 64 A100 80GB, local batch 1, selective op AC, 2973 tokens/s/GPU",
        64,
        a100,
        _llama(4096, 32, 32, 14336, "selective"),
        {},
        "bf16",
        64,
        1,
        FSDP2,
        2973.0,
        "tokens",
        "torchtitan's op-level selective AC recomputes every other matrix product; "
        "mtcore's selective recomputes the attention scores only (full recompute: -5%)",
    ),
    Row(
        "torchtitan Llama 3 70B, 64 A100",
        f"{_TITAN}: FSDP2 on 64 A100 80GB, local batch 1, full AC, 331 tokens/s/GPU",
        64,
        a100,
        _llama(8192, 80, 64, 28672, "full"),
        {},
        "bf16",
        64,
        1,
        FSDP2,
        331.0,
        "tokens",
    ),
    Row(
        "torchtitan Llama 3.1 8B, 8 H100",
        f"{_TITAN} Table 1: FSDP2 on 8 H100 96GB at 500 W, local batch 2, selective AC, "
        "5762 tokens/s/GPU, 82.4 GiB",
        8,
        grand_teton,
        _llama(4096, 32, 32, 14336, "selective"),
        {},
        "bf16",
        16,
        2,
        FSDP2,
        5762.0,
        "tokens",
        "the 500 W power limit (clocks) and op-level selective AC are not modelled; "
        "memory too: 125 GiB planned, 82.4 measured",
    ),
]
