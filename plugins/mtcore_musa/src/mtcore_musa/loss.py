"""``cross_entropy`` on musa: torch_musa's ``F.cross_entropy`` runs muDNN's fused loss.

torch_musa v2.7.1 patches torch's ``cross_entropy_loss`` (torch_patches/
aten_src_ATen_native_LossNLL.cpp.patch): a 2-D input without label smoothing asks
``aten::cross_entropy_loss_2d_choice`` and, when it answers 1, calls
``aten::_fused_cross_entropy_loss_2d_forward`` (muDNN's ``CrossEntropyLoss``, with its
reduction, ignore_index and weight; backward ``_fused_cross_entropy_loss_2d_backward``
through tools_autograd_derivatives.yaml.patch). The choice (csrc/aten/ops/Loss.cpp:557,
``CrossEntropyLoss2dChoice``) is ``device_prop->major >= 3`` and a 1-D target and a
floating input. So on arch >= 3.0 ``mtcore.ops.torch_native.fused_cross_entropy``
(``F.cross_entropy(logits.float(), target, ignore_index=..., reduction="none")``) is
muDNN's kernel; below it is torch's log_softmax + nll_loss, which is no faster than the
reference and is not registered.

The float32 cast stays: ``FusedCrossEntropyLoss2dFwd`` allocates its output with the
input's options (Loss.cpp:580), so bf16 logits would give bf16 losses, and the op's
contract is float32 losses from a float32 log-softmax.

Where mtcore calls it: ``mtcore.parallel.tensor.vocab_parallel_cross_entropy`` at
tp == 1, where the loss is exactly a full cross entropy, and BERT's pair head. At tp > 1
each rank holds a vocabulary shard and the loss needs the max and sum of exps over all
of them; the fused op's per-row answer is the shard's own ``logsumexp - x[target]``.
The shard's log-sum-exp can be had from it (``CE(x, t') + x[t']`` for any in-shard t')
and merged across ranks, but backward would then need a hand-written product of
muDNN's shard softmax and each rank's ``exp(lse_r - LSE)``, for at most the max, exp
and sum passes the vocab-parallel loss makes in plain torch; unmeasured without a MUSA
device, so the tp > 1 path stays as it is.
"""

from __future__ import annotations

FUSED_CROSS_ENTROPY_OP = "aten::_fused_cross_entropy_loss_2d_forward"
# Loss.cpp:557: ``const bool device_support = (device_prop->major >= 3);``
FUSED_CROSS_ENTROPY_MIN_CAPABILITY = (3, 0)
