#!/bin/bash
# Llama-2 7B pretraining on 8 accelerators, in the style of MT-MegatronLM's
# examples/llama2/run_llama2_7b.sh (the arguments only; the paths are placeholders).
set -u
export CUDA_DEVICE_MAX_CONNECTIONS=1

WORLD_SIZE=${WORLD_SIZE:-1}
GPUS_PER_NODE=8
TP_SIZE=2
PP_SIZE=2
MICRO_BATCH_SIZE=1
GLOBAL_BATCH_SIZE=64
CHECKPOINT_PATH=${CHECKPOINT_PATH:-/data/checkpoints/llama2_7b}
DATA_PATH=/data/llama2/wudao_text_document
TOKENIZER_PATH=/data/llama2/tokenizer.model

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $WORLD_SIZE
    --master_addr localhost
    --master_port 6000
)

MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 11008
    --num-attention-heads 32
    --seq-length 4096
    --max-position-embeddings 4096
    --position-embedding-type rope
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --use-flash-attn
    --transformer-impl local
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

TRAINING_ARGS=(
    --micro-batch-size ${MICRO_BATCH_SIZE}
    --global-batch-size ${GLOBAL_BATCH_SIZE}
    --train-iters 250000
    --lr 3.0e-4
    --min-lr 3.0e-5
    --lr-decay-style cosine
    --lr-warmup-iters 2000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --bf16
    --use-distributed-optimizer
    --seed 42
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size ${TP_SIZE}
    --pipeline-model-parallel-size ${PP_SIZE}
    --sequence-parallel
)

DATA_ARGS=(
    --data-path $DATA_PATH
    --tokenizer-type Llama2Tokenizer
    --tokenizer-model ${TOKENIZER_PATH}
    --split 949,50,1
)

OUTPUT_ARGS=(
    --log-interval 1
    --save-interval 10000
    --eval-interval 1000
    --eval-iters 10
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --tensorboard-dir ${CHECKPOINT_PATH}/tensorboard
)

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${OUTPUT_ARGS[@]}
