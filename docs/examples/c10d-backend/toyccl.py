"""A c10d backend registered by name, as a new accelerator's collective library does it.

torch.distributed finds a collective library by the name given to
``init_process_group(backend=...)``. A library that is not built into torch registers
that name with ``torch.distributed.Backend.register_backend`` when it is imported; the
function it registers builds the process group of every group (the world, and each
``new_group``). mtcore's ``Collective("toyccl")`` then works unchanged.

``toyccl`` is a Python ``ProcessGroup`` subclass that forwards each operation to gloo
and counts the calls, so that one can see mtcore reach it. A real library runs these
operations on its device, usually in C++ (a ``c10d::Backend``), under the same names
and arguments.

    python docs/examples/c10d-backend/toyccl.py    # 2 ranks of Collective("toyccl")

prints one JSON line: what each operation gave on rank 0 and the calls each group saw.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NAME = "toyccl"


class ToyProcessGroup(dist.ProcessGroup):
    """One group of toyccl: each operation torch.distributed (and so mtcore) calls."""

    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        # Its own key prefix: gloo's connection keys must not meet the caller's.
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore(NAME, store), rank, size, timeout)
        self.calls: Counter[str] = Counter()

    def getBackendName(self) -> str:  # the C++ name, which torch calls
        return NAME

    def _forward(self, op: str, method: str, *args):
        self.calls[op] += 1
        return getattr(self._gloo, method)(*args)  # a Work: torch waits on it

    def allreduce(self, tensors, opts):
        return self._forward("allreduce", "allreduce", tensors, opts)

    def all_gather_single(self, output, input, opts):
        return self._forward("all_gather_single", "_allgather_base", output, input, opts)

    def reduce_scatter_single(self, output, input, opts):
        return self._forward("reduce_scatter_single", "_reduce_scatter_base", output, input, opts)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts):
        args = (output, input, output_splits, input_splits, opts)
        return self._forward("all_to_all_single", "alltoall_base", *args)

    def broadcast(self, tensors, opts):
        return self._forward("broadcast", "broadcast", tensors, opts)

    def send(self, tensors, dst: int, tag: int):
        return self._forward("send", "send", tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int):
        return self._forward("recv", "recv", tensors, src, tag)

    def barrier(self, opts):
        return self._forward("barrier", "barrier", opts)


def create_process_group(store, rank: int, size: int, timeout) -> ToyProcessGroup:
    """What torch.distributed calls for each new group of backend ``toyccl``."""
    return ToyProcessGroup(store, rank, size, timeout)


# At import, as a library does: every rank imports it before its first process group.
dist.Backend.register_backend(NAME, create_process_group, devices=["cpu"])


def rank_main(rank: int, world_size: int, init_method: str) -> None:
    """Every operation mtcore's parallel code uses, through Collective(NAME)."""
    from mtcore.backend import P2P, Collective, gloo_capabilities

    # toyccl forwards to gloo, so it can do what gloo does on this torch, no more.
    collective = Collective(NAME, gloo_capabilities())
    collective.init_process_group(rank, world_size, init_method=init_method, timeout_s=60)
    out = {"backend": dist.get_backend()}

    mean = torch.full((2,), float(rank + 1))
    collective.all_reduce(mean, "avg")
    total = torch.ones(2)
    collective.all_reduce(total, "sum", async_op=True).wait()
    out["all_reduce"] = {"avg": mean.tolist(), "async sum": total.tolist()}
    gathered = torch.empty(2 * world_size)
    collective.all_gather(gathered, torch.full((2,), float(rank)))
    out["all_gather"] = gathered.tolist()
    shard = torch.empty(1)
    collective.reduce_scatter(shard, torch.arange(float(world_size)))
    out["reduce_scatter"] = shard.tolist()
    sent = torch.full((2,), float(rank))
    collective.broadcast(sent, src=world_size - 1)
    out["broadcast"] = sent.tolist()
    exchanged = torch.empty(world_size)
    collective.all_to_all(exchanged, torch.full((world_size,), float(rank)))
    out["all_to_all"] = exchanged.tolist()
    received = torch.empty(1)
    ring = [
        P2P("send", torch.full((1,), float(rank)), (rank + 1) % world_size),
        P2P("recv", received, (rank - 1) % world_size),
    ]
    for handle in collective.batch_send_recv(ring):
        handle.wait()
    out["send_recv"] = received.tolist()
    fp8 = torch.full((4,), 2.0 * (rank + 1)).to(torch.float8_e4m3fn)  # as bytes: the fallback
    collective.broadcast(fp8, src=0)
    out["broadcast float8"] = fp8.float().tolist()
    collective.barrier()

    pair = collective.new_group([0, 1])  # a second group: the creator runs again
    ones = torch.ones(1)
    collective.all_reduce(ones, group=pair)
    out["subgroup all_reduce"] = ones.tolist()
    out["calls"] = {"world": dict(dist.group.WORLD.calls), "subgroup": dict(pair.calls)}
    if rank == 0:
        print(json.dumps(out, sort_keys=True))
    collective.destroy()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="toyccl-") as rendezvous:
        mp.spawn(rank_main, args=(2, f"file://{rendezvous}/init"), nprocs=2)
