#!/bin/bash
# A tiny Llama-style GPT on 4 ranks (tensor parallel 2 x pipeline parallel 2), written as
# MT-MegatronLM's examples write their launch scripts: the walk-through of
# docs/migrating-from-megatron.md converts it with `mtcore convert megatron-args`.
set -euo pipefail

GPUS_PER_NODE=4
TP=2
PP=2
CHECKPOINT_PATH=${CHECKPOINT_PATH:-megatron/gpt_tiny}

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes 1
    --master_addr localhost
    --master_port 6000
)

GPT_ARGS=(
    --num-layers 4
    --hidden-size 128
    --ffn-hidden-size 384
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --seq-length 128
    --max-position-embeddings 128
    --position-embedding-type rope
    --normalization RMSNorm
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --transformer-impl local
    --tensor-model-parallel-size $TP
    --pipeline-model-parallel-size $PP
    --micro-batch-size 4
    --global-batch-size 16
    --train-iters 200
    --lr 2.0e-3
    --min-lr 2.0e-4
    --lr-decay-style cosine
    --lr-warmup-iters 10
    --weight-decay 0.1
    --clip-grad 1.0
    --seed 1234
)

DATA_ARGS=(
    --mock-data
    --tokenizer-type NullTokenizer
    --vocab-size 4096
)

OUTPUT_ARGS=(
    --log-interval 10
    --eval-interval 100
    --eval-iters 2
    --save-interval 100
    --save runs/gpt_tiny/checkpoints
    --load $CHECKPOINT_PATH
)

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${GPT_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${OUTPUT_ARGS[@]}
