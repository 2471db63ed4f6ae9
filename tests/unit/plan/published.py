"""Published training throughput rows, as data (the planner's tests check each).

NARAYANAN_2021: Table 1 of Narayanan et al. 2021 (arXiv 2104.04473), A100 80GB,
seq 2048, vocab 51,200, full activation recompute, fp16, TFLOP/s per GPU counted
with recompute (their eq. 3, the 96 B s l h^2 formula). Micro-batch sizes are not
in the table: 1 is assumed (their sec. 5.1 runs use small micro-batches). Megatron
in 2021 reduced data-parallel gradients after backward (no overlap), so these rows
are predicted with ``dp_overlap="none"``.
"""

from __future__ import annotations

# params, hidden, layers, heads, tp, pp, gpus, batch, TFLOP/s per GPU
NARAYANAN_2021 = [
    ("1.7B", 2304, 24, 24, 1, 1, 32, 512, 137.0),
    ("18.4B", 6144, 40, 48, 8, 1, 256, 1024, 135.0),
    ("76.1B", 10240, 60, 80, 8, 4, 1024, 1792, 140.0),
    ("145.6B", 12288, 80, 96, 8, 8, 1536, 2304, 148.0),
    ("310.1B", 16384, 96, 128, 8, 16, 1920, 2160, 155.0),
    ("529.6B", 20480, 105, 128, 8, 35, 2520, 2520, 163.0),
    ("1T", 25600, 128, 160, 8, 64, 3072, 3072, 163.0),
]
FITTED = {"1.7B", "1T"}  # the two rows the efficiency constants were fitted on


def narayanan_config(hidden, layers, heads, tp, pp, gpus, batch, micro_batch=1):
    """The TrainConfig of one Table 1 row (GPT-3 architecture: 4h GELU MLP, LayerNorm,
    learned positions, tied embeddings, dropout 0.1)."""
    from mtcore.training.config import TrainConfig

    return TrainConfig.model_validate(
        {
            "model": {
                "family": "gpt",
                "style": "gpt2",
                "hidden_size": hidden,
                "num_layers": layers,
                "num_heads": heads,
                "seq_len": 2048,
                "vocab_size": 51200,
                "dropout": 0.1,
                "recompute": "full",
            },
            "parallel": {"tp": tp, "pp": pp},
            "precision": {"dtype": "fp16"},
            "training": {"global_batch_size": batch, "micro_batch_size": micro_batch},
        }
    )


# MEGATRON_CORE_2024: the Megatron-LM README's weak-scaling table (images/model_table.png,
# commit f2e5db402c, July 2024; the rows in ../shared/reference/anchors.md), H100 80GB,
# seq 4096, vocab 131,072, bf16, dp 48. TFLOP/s per GPU are model FLOPs (MFU = it / 989).
# The runs overlap dp (--overlap-grad-reduce --overlap-param-gather, distributed
# optimizer), tp (--tp-comm-overlap) and pp communication with compute; they are
# predicted with those options. Micro-batch 1, no recompute and sequence parallel
# wherever tp > 1 are assumptions (the table does not say).
# params, hidden, layers, heads, tp, pp, gpus, batch, TFLOP/s per GPU
MEGATRON_CORE_2024 = [
    ("1.7B", 2048, 24, 16, 1, 1, 48, 192, 408.8),
    ("7.1B", 4096, 30, 32, 2, 1, 96, 192, 465.9),
    ("16B", 6144, 32, 48, 4, 1, 192, 192, 489.1),
    ("70B", 8192, 84, 64, 8, 2, 768, 384, 419.7),
    ("177B", 12288, 96, 96, 8, 6, 2304, 1152, 432.8),
]


def megatron_core_config(hidden, layers, heads, tp, pp, gpus, batch, micro_batch=1):
    """One README row: GPT with a 4h GELU MLP, untied embeddings, ZeRO-1 over dp."""
    from mtcore.training.config import TrainConfig

    return TrainConfig.model_validate(
        {
            "model": {
                "family": "gpt",
                "style": "gpt2",
                "tie_embeddings": False,
                "hidden_size": hidden,
                "num_layers": layers,
                "num_heads": heads,
                "seq_len": 4096,
                "vocab_size": 131072,
                "dropout": 0.1,
            },
            "parallel": {"tp": tp, "pp": pp, "sequence_parallel": tp > 1, "zero1": True},
            "precision": {"dtype": "bf16"},
            "training": {"global_batch_size": batch, "micro_batch_size": micro_batch},
        }
    )
