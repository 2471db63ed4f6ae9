"""mtcore against Megatron-Core itself: the same models, side by side, on CPU ranks.

    .venv/bin/python benchmarks/bench_megatron.py [--configs tp1 tp2 tp2-sp llama-tp2]
        [--rounds 4 --steps-per-round 3 --warmup 2] [--load K] [--ce-reps 20]
        [--compare-overlap] [--compare-shm] [--profile-steps 2] [--json]
    .venv/bin/python benchmarks/bench_megatron.py --configs pp2 pp2-tp2 moe-ep2 \\
        bert-tp2 t5-tp2 dp2-distopt --rounds 4         # issue 33 item 2

Megatron-Core 0.16.1 comes with ``make setup`` (the ``[megatron]`` extra; also
``benchmarks/requirements-megatron.txt``); it is never a dependency of mtcore. The
code is the package ``benchmarks/against_megatron/`` (shapes and configurations,
CPU shims, each side, the rank's work, the report); this file is its command line.

Both sides train the same model shape (``against_megatron.configs``: 4 layers, hidden
256, 8 heads, seq 256, batch 4 per data-parallel rank, vocab 1024, fp32) with AdamW
(lr 1e-3, betas 0.9/0.95, no weight decay, no clipping, constant lr) on the same
token batches (rows that follow a fixed permutation of the vocabulary, so the loss
can fall), one torch thread per rank:

* **mtcore** (``mtcore_side``): the trainer's ``Engine`` on the ``cpu`` backend; its
  tp and data-parallel groups' all-reduce, all-gather and reduce-scatter through the
  cpu backend's shared-memory channel, as in ``mtcore train`` (``--compare-shm`` adds a
  side with those groups on gloo: ``mtcore-gloo``); every other call (all-to-all,
  pipeline send/recv), and all of Megatron-Core's, through gloo.
* **Megatron-Core** with its pure-PyTorch local specs, made to run on CPU by the
  changes listed in ``against_megatron/cpu_shims.py`` (none changes its arithmetic).

Configurations (``against_megatron.configs.CONFIGS``; default: the first four):

* ``tp1``, ``tp2``, ``tp2-sp`` (GPT-2 style: LayerNorm, tanh-GELU, learned positions,
  tied output, biases), ``llama-tp2`` (RMSNorm, SwiGLU, RoPE, 4 kv heads of 8,
  untied): Megatron's ``GPTModel`` in a plain loop with ``torch.optim.AdamW`` (no DDP;
  ``megatron_gpt.LegacyGPTSide``), one micro-batch.
* ``pp2`` (2 ranks) and ``pp2-tp2`` (4 ranks): GPT-2 style, 1F1B over 4 micro-batches
  of 1 row (the batch of 4 split; 1F1B on 2 stages needs at least 2). Megatron:
  ``forward_backward_pipelining_without_interleaving``.
* ``moe-ep2`` (2 ranks, dp 2 = ep 2): Llama style with every MLP a mixture of 8
  SwiGLU experts (each the dense MLP's size), top-2 (softmax over the 2 chosen
  logits), load-balancing loss 1e-2, dropless; Megatron's ``MoELayer``
  (``get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)``) with its
  ``alltoall`` token dispatcher, mtcore's with its ``alltoall`` dispatcher.
* ``bert-tp2``, ``t5-tp2`` (2 ranks): Megatron's ``BertModel`` and ``T5Model``; what
  their local specs cannot express as mtcore's models do (BERT pre-LN vs post-LN; T5
  learned absolute positions vs relative bias) is in ``megatron_encoders``.
* ``dp2-distopt`` (2 ranks): GPT-2 style, dp 2, mtcore's ZeRO-1
  (``DistributedAdamW``) against Megatron's DDP and, since its ``DistributedOptimizer``
  refuses CPU parameters, torch AdamW (``megatron_training``; the report says so).

The new configurations run Megatron the way Megatron-LM does (``megatron_training``):
its ``DistributedDataParallel``, ``get_megatron_optimizer``, ``finalize_model_grads``
and ``get_forward_backward_func()``.

Loss curves: each side's loss per step is printed (mean over micro-batches and data
replicas). The weights come from each side's own initialiser (both normal, std 0.02;
BERT and T5 as their models draw them), so the curves start equal only in value (ln
1024 = 6.93 for the language models, plus ln 2 for BERT's pair head) and are compared
in shape, not number for number: the two layouts of the parameters (fused qkv order,
tp sharding, expert placement) differ, and the benchmark copies no weights between
them.

Timing: in each round every side runs ``--steps-per-round`` steps, the side that
goes first alternating from round to round, so load from other processes falls on
both alike. Reported (rank 0): median step times, the **paired ratio** (median
over rounds of mtcore's round time / Megatron's in the same round), each side's
loss per step, and a breakdown from extra instrumented steps after the timed ones
(``against_megatron.instrument``): collective wait (time inside ``torch.distributed``
collectives, mtcore's shared-memory channel calls and ``wait()`` on their handles;
it overlaps the rest) and calls, and where a step makes one
``torch.autograd.backward`` call (the first four configurations), forward, backward
and optimizer+rest. The vocabulary-parallel cross entropy of both on the same
``[1024, 512]`` logit shards is timed too (``--ce-reps``; tp2 GPT configurations).

``--profile-steps`` (default 2; GPT configurations at pp 1, MoE included) profiles
extra steps of each side with ``torch.profiler`` (``against_megatron.op_profile``):
time in matrix products and fused attention, each side's top ops by self CPU time
(the non-GEMM shares: norms, attention, activations, copies, collectives' waits,
optimizer), and the **GEMM floor**: every matrix product of mtcore's profiled steps,
with its recorded shapes, replayed alone on the rank's one thread (the fastest of a
few calls), summed per step; the step is printed as a multiple of it for each side
(both sides make the same products). Dense configurations also print the weight-
product FLOPs over this core's matmul rate, the floor of earlier sessions. ``--compare-overlap`` runs two mtcore
sides against the same Megatron steps: the column-parallel backward overlapped
(``MTCORE_TP_OVERLAP=1``, the default) and blocking (``=0``). ``--load K`` starts K
processes that spin on the CPU for the length of the run. The ``uptime`` line is
printed at the start and at the end of every configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _timing import load_average
from against_megatron.configs import CONFIGS, DEFAULT_CONFIGS
from against_megatron.instrument import spin_load
from against_megatron.rank_work import rank_main
from against_megatron.report import report, summary_table


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--configs", nargs="+", default=list(DEFAULT_CONFIGS), choices=list(CONFIGS)
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--phase-steps", type=int, default=4, help="instrumented steps per side")
    parser.add_argument("--ce-reps", type=int, default=20, help="cross-entropy timings (0: skip)")
    parser.add_argument(
        "--profile-steps", type=int, default=2,
        help="profiled steps per side for the matmul/attention times and GEMM floor (0: skip)",
    )  # fmt: skip
    parser.add_argument("--load", type=int, default=0, metavar="K", help="K spinning processes")
    parser.add_argument(
        "--compare-overlap",
        action="store_true",
        help="two mtcore sides: MTCORE_TP_OVERLAP=1 (overlapped, default) and =0 (blocking)",
    )
    parser.add_argument(
        "--compare-shm",
        action="store_true",
        help="a second mtcore side with its tp and dp groups on gloo (MTCORE_SHM_COLLECTIVES=0)",
    )
    parser.add_argument("--json", action="store_true", help="also print the raw results")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps_per_round < 1 or args.phase_steps < 1:
        parser.error("--rounds, --steps-per-round and --phase-steps must be >= 1")
    return args


def run_config(name: str, args: argparse.Namespace) -> dict:
    """Rank 0's result of ``name`` on its ranks."""
    from mtcore.testing.distributed import run_ranks

    return run_ranks(
        rank_main, CONFIGS[name].world, name, args.rounds, args.steps_per_round, args.warmup,
        args.phase_steps, args.ce_reps, args.compare_overlap, args.profile_steps,
        args.compare_shm, timeout_s=1800, env={"OMP_NUM_THREADS": "1"},
    )[0]  # fmt: skip


def main() -> None:
    args = parse_args()
    summary = {}
    with spin_load(args.load):
        print(f"background load: {args.load} spinning process(es); 1 torch thread per rank")
        for name in args.configs:
            print(f"\nload at start of {name}: {load_average()}")
            res = run_config(name, args)
            summary[name] = report(name, res)
            print(f"load at end of {name}: {load_average()}")
            if args.json:
                print(json.dumps(res))
    summary_table(summary)


if __name__ == "__main__":
    main()
