"""Megatron-Core's training step as Megatron-LM runs it, for every configuration but
the first four: the model in Megatron's ``DistributedDataParallel`` (its contiguous
fp32 gradient buffer, reduced over dp in ``finalize_model_grads``, which also sums a
tied embedding's halves over the first and last pipeline stage), Megatron's optimizer
from ``get_megatron_optimizer`` (fp32: ``FP32Optimizer`` over torch's AdamW, since
neither Transformer Engine's nor Apex's fused Adam is installed), and
``get_forward_backward_func()``: ``forward_backward_no_pipelining`` at pp = 1,
``forward_backward_pipelining_without_interleaving`` (1F1B) at pp = 2. The loss is
agreed on every rank in one all-reduce (mtcore's engine does the same).

``dp2-distopt``: Megatron's ``DistributedOptimizer`` does not run on CPU parameters:
its constructor accepts only ``torch.cuda.FloatTensor`` / ``HalfTensor`` /
``BFloat16Tensor`` parameters (``distrib_optimizer.py`` raises ``TypeError`` on a
``torch.FloatTensor``). Its side is therefore Megatron's DDP + torch AdamW
(``FP32Optimizer``), every rank updating every parameter, against mtcore's ZeRO-1;
the report prints the refusal (the side's ``note``). The distributed optimizer is
tried first on every run, so a Megatron-Core that accepts CPU parameters would be
measured as itself.
"""

from __future__ import annotations

import torch

from .configs import BETAS, EPS, LR, SEQ, BenchConfig
from .megatron_encoders import bert_forward, bert_loss, build_bert, build_t5, t5_forward
from .megatron_gpt import build_gpt, gpt_forward


def _model_and_forward(cfg: BenchConfig):
    if cfg.family == "bert":
        return build_bert(cfg), bert_forward, bert_loss
    if cfg.family == "t5":
        return build_t5(cfg), t5_forward, lambda out, batch: out.float().mean()
    return build_gpt(cfg), gpt_forward, lambda out, batch: out.float().mean()


def _build(cfg: BenchConfig, distributed: bool):
    """(model, its DDP wrapper, Megatron's optimizer), the distributed optimizer and its
    buffer layout when ``distributed``."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed import DistributedDataParallelConfig as DDPConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    module, forward, loss = _model_and_forward(cfg)
    ddp_config = DDPConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=distributed,
    )  # fmt: skip
    model = DistributedDataParallel(module.config, ddp_config, module)
    config = OptimizerConfig(
        optimizer="adam", lr=LR, min_lr=LR, weight_decay=0.0, adam_beta1=BETAS[0],
        adam_beta2=BETAS[1], adam_eps=EPS, clip_grad=0.0, params_dtype=torch.float32,
        use_distributed_optimizer=distributed,
    )  # fmt: skip
    return module, model, get_megatron_optimizer(config, [model]), forward, loss


class MegatronTrainerSide:
    def __init__(self, cfg: BenchConfig):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func

        ps.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
            expert_model_parallel_size=cfg.ep,
        )  # fmt: skip
        self.note = ""
        try:
            built = _build(cfg, distributed=cfg.zero1)
        except TypeError as err:
            if not cfg.zero1:
                raise
            self.note = f"DistributedOptimizer refused: {err}".replace("\n", " ")
            built = _build(cfg, distributed=False)
        module, self.model, self.optimizer, self.forward, self.loss = built
        for group in self.optimizer.param_groups:
            group["lr"] = LR  # no OptimizerParamScheduler: constant lr
        module.config.finalize_model_grads_func = finalize_model_grads
        module.config.no_sync_func = self.model.no_sync
        self.forward_backward = get_forward_backward_func()
        self.last_stage = ps.is_pipeline_last_stage()
        self.replicas = cfg.tp * cfg.dp  # ranks of the last stage, each holding a loss

    def _step_function(self, data_iter, model):
        batch = next(data_iter)
        output = self.forward(model, batch)

        def loss_func(out):
            loss = self.loss(out, batch)
            return loss, {"loss": loss.detach().clone()}  # the schedule divides loss in place

        return output, loss_func

    def step(self, micro_batches: list[dict]) -> float:
        import torch.distributed as dist

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self.forward_backward(
            forward_step_func=self._step_function, data_iterator=iter(micro_batches),
            model=[self.model], num_microbatches=len(micro_batches), seq_length=SEQ,
            micro_batch_size=micro_batches[0]["tokens"].shape[0], forward_only=False,
        )  # fmt: skip
        self.optimizer.step()
        mine = torch.stack([d["loss"] for d in losses]).mean() if self.last_stage else None
        total = torch.zeros(1) if mine is None else mine.reshape(1).clone()
        dist.all_reduce(total)
        return total.item() / self.replicas
