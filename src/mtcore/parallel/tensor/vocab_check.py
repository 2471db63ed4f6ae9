"""Token ids and labels must index the vocabulary: checked at the layer, never masked.

Under tensor parallelism the embedding and the loss mask every id outside a rank's
vocabulary shard, because that is how a shard leaves the other ranks' rows alone. An
id outside the *whole* vocabulary is then masked on every rank: it embeds to zeros,
its loss is ln V with a zero gradient, and the job trains on nothing and exits 0. At
tp 1 the same id fails deep inside the lookup. So both layers check their ids first,
in every layout, and leave the numerics of valid ids untouched.

Cost. On the host, one ``aminmax`` over the ids and two scalar reads (about 10 us for
a 16 x 2048 batch): a CPU tensor's ``.item()`` is a memory read, so the error can name
the offending id. On an accelerator a host read per step would stall the stream, so
the check is ``torch._assert_async``: queued like any kernel, it fails the job at the
next synchronisation. The device cannot format the id into its message (CUDA reports
a device-side assert), so the host-side data check (``mtcore.data.indexed``) is the
one that names the file; this one is the last line of defence. A device without an
async assert gets the host check.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_vocab_ids(
    ids: Tensor, vocab_size: int, what: str = "token id", ignore_index: int | None = None
) -> None:
    """Raise IndexError unless every id (other than ``ignore_index``) is in ``[0, vocab_size)``."""
    if ids.numel() == 0:
        return
    if ignore_index is not None:
        ids = ids.masked_fill(ids == ignore_index, 0)
    if ids.device.type != "cpu" and assert_on_device(ids, vocab_size, what):
        return
    lo, hi = ids.aminmax()
    if lo < 0 or hi >= vocab_size:
        bad = int(lo) if lo < 0 else int(hi)
        raise IndexError(_message(what, bad, vocab_size))


def assert_on_device(ids: Tensor, vocab_size: int, what: str) -> bool:
    """Queue the range check as a device-side assertion, without a host sync.

    Returns False where the device has no async assert (the caller checks on the host).
    On the host ``torch._assert_async`` raises at once, which is how it is tested.
    """
    in_range = ((ids >= 0) & (ids < vocab_size)).all()
    try:
        torch._assert_async(in_range, _message(what, None, vocab_size))
    except NotImplementedError:
        return False
    return True


def _message(what: str, bad: int | None, vocab_size: int) -> str:
    which = f"{what} {bad} is" if bad is not None else f"a {what} is"
    return (
        f"{which} outside the vocabulary [0, {vocab_size}): corrupt token data, or a "
        f"tokenizer with more ids than the model's vocab_size"
    )
