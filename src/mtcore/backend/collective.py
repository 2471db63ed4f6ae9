"""The collective interface: every communication call parallel code makes.

One implementation over ``torch.distributed`` serves gloo, NCCL, MCCL and any
other c10d backend; what differs between them is data (the c10d name and a
capability table). Where a backend cannot move a dtype natively the call still
works through a stated fallback (FP8 moved as bytes, reductions in a wider
dtype), and ``support()`` tells which path a call takes.

All torch.distributed calls of the project live here, so that API moves
between torch releases are handled in one place.

A group made with ``new_group(ranks, latency_bound=True)`` (tensor and data parallelism's)
may take a faster path for CPU tensors when every member runs on this host: a
shared-memory channel (``mtcore.backend.shared_memory``) on the calling thread,
for backends that declare ``same_host_channels`` (the cpu backend).
``MTCORE_SHM_COLLECTIVES=0`` keeps every group on its c10d backend.
"""

from __future__ import annotations

import contextlib
import enum
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from mtcore.backend import shared_memory, shared_memory_p2p
from mtcore.backend.shared_memory import PeerGone, SharedMemoryChannel
from mtcore.backend.shared_memory_p2p import SharedMemoryMailbox

SHARED_MEMORY_ENV = "MTCORE_SHM_COLLECTIVES"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DEFAULT_TIMEOUT_S = 300.0
# How long ranks may take to arrive at process-group creation (see _gather_ranks).
STARTUP_TIMEOUT_S = 300.0
# how long destroy() waits for torch to close the process groups (see destroy)
DESTROY_WAIT_S = 30.0
OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "send_recv",
    "barrier",
)
_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "avg": dist.ReduceOp.AVG,
}
_REDUCING = ("all_reduce", "reduce_scatter")


class Support(enum.Enum):
    NATIVE = "native"
    FALLBACK = "fallback"
    NONE = "none"


FallbackTable = Mapping[str, frozenset[torch.dtype]]


@dataclass(frozen=True)
class CollectiveCapabilities:
    """Which dtypes each op moves natively; the rest take the fallback.

    fallback_dtypes: per op, the dtypes the c10d backend cannot take natively,
    or a callable returning that table. A callable is read once, on first use:
    for backends whose answer depends on how the collective library was built,
    which only the vendor's module can tell, and which must not be imported
    when plugins are discovered (FP8's ``native_granularities`` works the same
    way). The fallback moves the tensor as raw bytes (uint8) for data movement
    and reduces it in float32, then casts back (FP8, or bf16 where the library
    lacks it). ``avg_supported`` is False where the backend lacks ReduceOp.AVG
    (then AVG is SUM followed by a division). ``Support.NONE`` is for
    capability tables that subclass this one to declare an op missing.
    ``reduce_scatter_ops``: the reduce ops the backend's reduce-scatter computes
    correctly (None: all); the others run as an all-reduce of a float copy, of which
    each rank keeps its shard.
    """

    fallback_dtypes: FallbackTable | Callable[[], FallbackTable] = field(default_factory=dict)
    avg_supported: bool = True
    reduce_scatter_ops: frozenset[str] | None = None
    _table: dict[str, frozenset[torch.dtype]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def fallback_table(self) -> dict[str, frozenset[torch.dtype]]:
        """The fallback table, resolved (a callable source is called here, once)."""
        if self._table is None:
            source = self.fallback_dtypes
            table = source() if callable(source) else source
            resolved = {op: frozenset(dtypes) for op, dtypes in table.items()}
            object.__setattr__(self, "_table", resolved)  # a cache: frozen for callers
        return self._table

    def support(self, op: str, dtype: torch.dtype) -> Support:
        if op not in OPS:
            raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")
        if dtype in self.fallback_table().get(op, frozenset()):
            return Support.FALLBACK
        return Support.NATIVE


def fp8_fallback_everywhere() -> dict[str, frozenset[torch.dtype]]:
    """Capability data for a backend that carries no FP8 dtype (gloo; libraries built without it)."""
    return {op: frozenset(FP8_DTYPES) for op in OPS if op != "barrier"}


# ProcessGroupGloo gained ReduceOp.AVG in torch 2.8 (pytorch/pytorch#149781), and its
# reduce_scatter_tensor honours MAX and MIN only from 2.8: torch 2.7's returns the SUM
# for them, silently (the conformance kit's reduce_scatter max/min checks catch it).
GLOO_FIXED_IN = "2.8"


def gloo_capabilities() -> CollectiveCapabilities:
    """What gloo carries on the installed torch: no FP8 dtype, and before torch 2.8 no
    ReduceOp.AVG (sum, then divide) and a reduce-scatter that only sums."""
    fixed = torch.__version__ >= GLOO_FIXED_IN
    return CollectiveCapabilities(
        fp8_fallback_everywhere(),
        avg_supported=fixed,
        reduce_scatter_ops=None if fixed else frozenset({"sum"}),
    )


class CollectiveTimeout(RuntimeError):
    """A collective or a transfer did not complete within the process group's timeout:
    a peer stopped answering (stopped, hung, or gone). The message names the call and
    the ranks it waited for."""


# What gloo (and NCCL's socket transport) say when the process at the other end died or
# its host went away: the kernel closed or reset the connection.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe")


def _looks_like_timeout(error: RuntimeError) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


@contextlib.contextmanager
def _named(what: Callable[[], str], timeout_s: float):
    """Turn a c10d timeout, or a connection a dead peer closed, into a CollectiveTimeout
    saying which call and ranks it waited for."""
    try:
        yield
    except PeerGone as e:
        raise CollectiveTimeout(f"{what()}: {e}") from e
    except RuntimeError as e:
        if isinstance(e, CollectiveTimeout):
            raise
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if any(sign in first_line.lower() for sign in _PEER_LOST):
            detail = first_line.split(". This is typically")[0]
            raise CollectiveTimeout(
                f"{what()} failed: a peer closed the connection (it died, or its node went "
                f"down): {detail}"
            ) from e
        if not _looks_like_timeout(e):
            raise
        raise CollectiveTimeout(
            f"{what()} did not complete within {timeout_s:g} s (a peer stopped answering; "
            f"training.collective_timeout_s sets the limit): {first_line}"
        ) from e


class Handle:
    """An async collective's handle; ``wait()`` also runs any fallback's epilogue."""

    def __init__(
        self,
        work,
        epilogue: Callable[[], None] | None = None,
        what: Callable[[], str] | None = None,
        timeout_s: float | None = None,
    ):
        self._work = work
        self._epilogue = epilogue
        self._what, self._timeout_s = what, timeout_s

    def wait(self) -> None:
        if self._work is not None:
            if self._what is None:
                self._work.wait()
            else:
                with _named(self._what, self._timeout_s):
                    self._work.wait()
            self._work = None
        if self._epilogue is not None:
            self._epilogue()
            self._epilogue = None

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


@dataclass(frozen=True)
class P2P:
    """One send or receive in a batch: ``kind`` is "send" or "recv", ``peer`` a global rank."""

    kind: str
    tensor: torch.Tensor
    peer: int
    group: object | None = None


class Collective:
    """Collectives over one c10d backend. Groups are torch ProcessGroup objects.

    ``interface_variables``: the environment variables that pick the network interface of
    its traffic between nodes (its library's, e.g. ``NCCL_SOCKET_IFNAME``, then
    ``GLOO_SOCKET_IFNAME`` for the gloo groups every backend also uses); ``mtcore doctor``
    and a multi-node job's first lines say what each selects.

    ``same_host_channels``: the backend's tensors live in host memory, so latency-bound
    groups whose members share this host may use shared-memory channels (see the
    module docstring); the channel serves all-reduce, all-gather and reduce-scatter of
    contiguous CPU tensors and all-to-all of CPU tensors (the expert-parallel group's),
    and every other call stays on the c10d backend.
    """

    def __init__(
        self,
        c10d_backend: str,
        capabilities: CollectiveCapabilities | None = None,
        same_host_channels: bool = False,
        interface_variables: tuple[str, ...] = ("GLOO_SOCKET_IFNAME",),
    ):
        self.c10d_backend = c10d_backend
        # The environment variables that choose the network interface this backend's
        # traffic between nodes uses (``mtcore.backend.network``), the backend's own first.
        self.interface_variables = tuple(interface_variables)
        self.capabilities = capabilities or CollectiveCapabilities()
        self.same_host_channels = same_host_channels
        self.timeout_s = DEFAULT_TIMEOUT_S  # of every group: set by init_process_group
        self._channels: dict[int, tuple[object, SharedMemoryChannel]] = {}
        self._mailboxes: dict[int, tuple[object, SharedMemoryMailbox]] = {}

    # -- groups --------------------------------------------------------------------
    def init_process_group(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        init_method: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        device_id: torch.device | None = None,
    ) -> None:
        """Join the default group (env:// unless ``init_method`` says otherwise).

        ``timeout_s`` bounds every collective and transfer of this group and of every
        group ``new_group`` makes (torch's own default for new groups is longer): a
        call that a peer does not answer raises ``CollectiveTimeout`` naming it.
        """
        if dist.is_initialized():
            return
        self.timeout_s = timeout_s
        kwargs = {"backend": self.c10d_backend, "timeout": timedelta(seconds=timeout_s)}
        if device_id is not None:
            kwargs["device_id"] = device_id
        store, rank, world_size = self._gather_ranks(init_method, rank, world_size, timeout_s)
        dist.init_process_group(store=store, rank=rank, world_size=world_size, **kwargs)

    @staticmethod
    def _gather_ranks(init_method, rank, world_size, timeout_s: float):
        """Rendezvous, then wait until every rank has arrived, allowing for slow starts.

        Ranks start seconds apart on a loaded machine (imports, data preparation); a
        short ``timeout_s``, meant for a peer that stops answering mid-run, must not cut
        that start short. So the arrival wait gets at least ``STARTUP_TIMEOUT_S``, and
        the store then takes ``timeout_s`` for the group's own key exchange.
        """
        startup = timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S))
        store, rank, world_size = next(
            dist.rendezvous(
                init_method or "env://",
                rank=-1 if rank is None else rank,
                world_size=-1 if world_size is None else world_size,
                timeout=startup,
            )
        )
        store.set_timeout(startup)
        store.set(f"mtcore/arrived/{rank}", "1")
        store.wait([f"mtcore/arrived/{r}" for r in range(world_size)], startup)
        store.set_timeout(timedelta(seconds=timeout_s))
        return store, rank, world_size

    def is_initialized(self) -> bool:
        return dist.is_initialized()

    def new_group(self, ranks: Sequence[int], latency_bound: bool = False, p2p: bool = False):
        """A group over ``ranks``; every rank of the world must call this, in the same order.

        ``latency_bound``: the group carries blocking calls on the step's critical path
        (tensor parallelism; data parallelism's gradient reduction and ZeRO's param
        all-gather), so it gets a shared-memory channel where
        ``uses_shared_memory`` allows (its members set it up together, right here).
        ``p2p``: its sends and receives between neighbouring members (a pipeline's
        stages) go through a shared-memory mailbox, where the same allows
        (``shared_memory_p2p``).
        """
        timeout = timedelta(seconds=self.timeout_s)
        group = dist.new_group(ranks=list(ranks), backend=self.c10d_backend, timeout=timeout)
        member = len(ranks) > 1 and dist.get_rank() in ranks
        if member and (latency_bound or p2p) and self.uses_shared_memory():
            if latency_bound:
                self._open_channel(group)
            if p2p:
                size = shared_memory_p2p.mailbox_bytes(len(ranks))
                mailbox = self._open_segment(group, size, shared_memory_p2p.SharedMemoryMailbox)
                if mailbox is not None:
                    self._mailboxes[id(group)] = (group, mailbox)
        return group

    def uses_shared_memory(self) -> bool:
        """Whether latency-bound groups get shared-memory channels on this machine."""
        return (
            self.same_host_channels
            and os.environ.get(SHARED_MEMORY_ENV, "1") != "0"
            and shared_memory.supported_here()
        )

    def shared_memory_channel(self, group) -> SharedMemoryChannel | None:
        """The channel serving ``group``, if it has one."""
        entry = self._channels.get(id(group))
        return entry[1] if entry is not None and entry[0] is group else None

    def shared_memory_mailbox(self, group):
        """The mailbox serving ``group``'s sends and receives, if it has one."""
        entry = self._mailboxes.get(id(group))
        return entry[1] if entry is not None and entry[0] is group else None

    def _open_channel(self, group) -> None:
        members = dist.get_world_size(group)
        size = shared_memory.segment_bytes(members)
        channel = self._open_segment(group, size, SharedMemoryChannel)
        if channel is not None:
            self._channels[id(group)] = (group, channel)

    def _open_segment(self, group, size: int, make):
        """Map one segment of ``size`` bytes for ``group`` if every member can, as
        ``make(path, group rank, pids, timeout_s)`` (a channel or a mailbox): the first
        member creates it, the others open it by name (only a rank on the same host
        finds it) and see each other's pids (to notice one exiting). Otherwise None:
        the group stays on c10d."""
        rank, members = dist.get_rank(group), dist.get_world_size(group)
        box: list[str | None] = [None]
        if rank == 0:
            with contextlib.suppress(OSError):  # /dev/shm not writable: no channel
                box = [shared_memory.create_segment(members, size=size)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        path, channel = box[0], None
        if path is not None:
            try:  # every member reaches the agreement below, whatever happens here
                channel = make(path, rank, [0] * members, self.timeout_s)
            except (OSError, ValueError):
                channel = None
        pids: list[object] = [None] * members
        dist.all_gather_object(pids, (os.getpid(), channel is not None), group=group)
        every = all(opened for _, opened in pids)
        if every and channel is not None:
            channel.pids = tuple(pid for pid, _ in pids)
            channel.global_ranks = tuple(dist.get_process_group_ranks(group))
            every = all(shared_memory.pid_alive(pid) for pid in channel.pids)
        agreed = torch.tensor([1 if every else 0])
        dist.all_reduce(agreed, dist.ReduceOp.MIN, group=group)  # every member has mapped
        if rank == 0 and path is not None:
            shared_memory.unlink_segment(path)
        if agreed.item() == 1 and channel is not None:
            return channel
        if channel is not None:
            channel.close()
        return None

    def rank(self, group=None) -> int:
        return dist.get_rank(group)

    def world_size(self, group=None) -> int:
        return dist.get_world_size(group)

    def global_rank(self, group, group_rank: int) -> int:
        return dist.get_global_rank(group, group_rank) if group is not None else group_rank

    def destroy(self) -> None:
        """Close the channels and the process groups, waiting at most
        ``DESTROY_WAIT_S`` for torch: on torch 2.7.1 under load, ``destroy_process_group`` sometimes never
        returned after a job's last checkpoint (a gloo worker thread that does not
        join). The ranks are done by then, so a close that does not return in time is
        left to the process's exit."""
        for _, channel in (*self._channels.values(), *self._mailboxes.values()):
            channel.close()
        self._channels.clear()
        self._mailboxes.clear()
        if not dist.is_initialized():
            return
        closing = threading.Thread(target=dist.destroy_process_group, daemon=True)
        closing.start()
        closing.join(DESTROY_WAIT_S)

    def support(self, op: str, dtype: torch.dtype) -> Support:
        return self.capabilities.support(op, dtype)

    # -- reductions ----------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", group=None, async_op=False):
        """Reduce ``tensor`` in place over ``group``; returns a Handle when async."""
        with self._sync("all_reduce", group):
            if self.support("all_reduce", tensor.dtype) is Support.FALLBACK:
                wide = tensor.float()
                work = self._all_reduce_native(wide, op, group, async_op)
                return self._finish(work, lambda: tensor.copy_(wide), async_op, "all_reduce", group)
            work = self._all_reduce_native(tensor, op, group, async_op)
            return self._finish(work, None, async_op, "all_reduce", group)

    def _all_reduce_native(self, tensor, op, group, async_op):
        channel = self._channel_for(group, tensor, op=op)
        if channel is not None:
            channel.all_reduce(tensor, op)
            return None
        if op == "avg" and not self.capabilities.avg_supported:
            size = self.world_size(group)
            work = dist.all_reduce(tensor, dist.ReduceOp.SUM, group=group, async_op=async_op)
            if async_op:
                return _Chained(work, lambda: tensor.div_(size))
            tensor.div_(size)
            return None
        return dist.all_reduce(tensor, _reduce_op(op), group=group, async_op=async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", group=None, async_op=False
    ):
        """``output`` gets this rank's shard (dim 0) of the reduction of ``input``."""
        _check_shard(output, input, self.world_size(group), "reduce_scatter")
        epilogue = None
        if self.support("reduce_scatter", input.dtype) is Support.FALLBACK:
            target, output, input = (
                output,
                torch.empty_like(output, dtype=torch.float32),
                input.float(),
            )
            epilogue = lambda: target.copy_(output)  # noqa: E731
        reduce_op = op
        if op == "avg" and not self.capabilities.avg_supported:
            reduce_op = "sum"
            size = self.world_size(group)
            inner, out = epilogue, output
            epilogue = lambda: (out.div_(size), inner and inner())  # noqa: E731
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        channel = self._channel_for(group, output, input, op=reduce_op)
        supported = self.capabilities.reduce_scatter_ops
        with self._sync("reduce_scatter", group):
            if channel is not None:
                work = channel.reduce_scatter(output, input, reduce_op)
            elif supported is not None and reduce_op not in supported:
                work, epilogue = self._reduce_scatter_by_all_reduce(
                    output, input, reduce_op, group, async_op, epilogue
                )
            else:
                work = fn(output, input, op=_reduce_op(reduce_op), group=group, async_op=async_op)
        return self._finish(work, epilogue, async_op, "reduce_scatter", group)

    def _reduce_scatter_by_all_reduce(self, output, input, op, group, async_op, epilogue):
        """A reduce-scatter the backend gets wrong for ``op``: all-reduce a copy, keep
        this rank's shard (then the caller's epilogue)."""
        whole = input.clone(memory_format=torch.contiguous_format)
        work = dist.all_reduce(whole, _reduce_op(op), group=group, async_op=async_op)
        shard = whole.view(self.world_size(group), -1)[self.rank(group)]

        def keep_shard():
            output.view(-1).copy_(shard)
            if epilogue is not None:
                epilogue()

        return work, keep_shard

    # -- data movement -------------------------------------------------------------
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group=None, async_op=False):
        """Concatenate every rank's ``input`` along dim 0 into ``output``."""
        _check_shard(input, output, self.world_size(group), "all_gather")
        output_v, input_v = self._as_bytes_if_needed("all_gather", output, input)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        channel = self._channel_for(group, output_v, input_v)
        with self._sync("all_gather", group):
            if channel is not None:
                work = channel.all_gather(output_v, input_v)
            else:
                work = fn(output_v, input_v, group=group, async_op=async_op)
        return self._finish(work, None, async_op, "all_gather", group)

    def broadcast(self, tensor: torch.Tensor, src: int, group=None, async_op=False):
        """Copy ``tensor`` from global rank ``src`` to every rank of ``group``."""
        (view,) = self._as_bytes_if_needed("broadcast", tensor)
        with self._sync("broadcast", group):
            work = dist.broadcast(view, src=src, group=group, async_op=async_op)
        return self._finish(work, None, async_op, "broadcast", group)

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int] | None = None,
        input_splits: Sequence[int] | None = None,
        group=None,
        async_op=False,
    ):
        """Scatter dim-0 slices of ``input`` to ranks and gather theirs into ``output``."""
        output_v, input_v = self._as_bytes_if_needed("all_to_all", output, input)
        channel = self._channel_for(group)
        if channel is not None and channel.fits_rows(input_v):  # the same answer on every rank
            size = self.world_size(group)
            rows = output_v.shape[0] // size, input_v.shape[0] // size
            with self._sync("all_to_all", group):
                channel.all_to_all(
                    output_v, input_v,
                    output_splits if output_splits is not None else [rows[0]] * size,
                    input_splits if input_splits is not None else [rows[1]] * size,
                )  # fmt: skip
            return self._finish(None, None, async_op, "all_to_all", group)
        with self._sync("all_to_all", group):
            work = dist.all_to_all_single(
                output_v,
                input_v,
                output_split_sizes=list(output_splits) if output_splits is not None else None,
                input_split_sizes=list(input_splits) if input_splits is not None else None,
                group=group,
                async_op=async_op,
            )
        return self._finish(work, None, async_op, "all_to_all", group)

    def batch_send_recv(self, ops: Iterable[P2P]) -> list[Handle]:
        """Post sends and receives together so neighbours cannot deadlock on ordering.

        Transfers with a neighbour in a group that has a shared-memory mailbox go through
        it (both sides decide alike: the group and the peer); the rest through c10d."""
        p2p_ops, boxed = [], {}
        for i, item in enumerate(ops):
            if item.kind not in ("send", "recv"):
                raise ValueError(f"P2P kind must be 'send' or 'recv', got {item.kind!r}")
            mailbox = self._mailbox_for(item)
            if mailbox is not None:
                boxed[i] = (mailbox, item)
                continue
            fn = dist.isend if item.kind == "send" else dist.irecv
            (view,) = self._as_bytes_if_needed("send_recv", item.tensor)
            p2p_ops.append(dist.P2POp(fn, view, item.peer, item.group))
        if not p2p_ops and not boxed:
            return []
        peers = sorted({item.peer for item in ops})
        what = lambda: f"rank {dist.get_rank()}: send/recv with rank(s) {peers}"  # noqa: E731
        works = []
        if p2p_ops:
            with _named(what, self.timeout_s):
                works = dist.batch_isend_irecv(p2p_ops)
        if not boxed:
            return [Handle(w, None, what, self.timeout_s) for w in works]
        if len(works) not in (0, len(p2p_ops)):  # one work for a whole c10d batch
            raise RuntimeError("a c10d batch with one handle cannot be mixed with a mailbox")
        handles, rest = [], iter(works)
        for i in range(len(ops)):
            if i in boxed:
                mailbox, item = boxed[i]
                peer = dist.get_group_rank(item.group, item.peer)
                move = mailbox.send if item.kind == "send" else mailbox.recv
                work = move(item.tensor, peer)
            else:
                work = next(rest)
            handles.append(Handle(work, None, what, self.timeout_s))
        return handles

    def _mailbox_for(self, item: P2P):
        """The mailbox that carries ``item`` (a CPU tensor to or from a neighbour), or None."""
        if not self._mailboxes or item.group is None or item.tensor.device.type != "cpu":
            return None
        mailbox = self.shared_memory_mailbox(item.group)
        if mailbox is None or not mailbox.serves(dist.get_group_rank(item.group, item.peer)):
            return None
        return mailbox

    def barrier(self, group=None) -> None:
        with self._sync("barrier", group):
            dist.barrier(group=group)

    # -- helpers -------------------------------------------------------------------
    def _channel_for(self, group, *tensors: torch.Tensor, op: str | None = None):
        """The shared-memory channel that serves this call, or None (the c10d path)."""
        if not self._channels:
            return None
        channel = self.shared_memory_channel(group)
        if channel is None or (tensors and not channel.takes(*tensors, op=op)):
            return None
        return channel

    def _describe(self, op: str, group) -> Callable[[], str]:
        """A lazy description of a call for timeout messages: the op and its ranks."""

        def what() -> str:
            try:
                ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            except Exception:  # the group may be gone by the time the error is reported
                ranks = "?"
            return f"rank {dist.get_rank()}: {op} over ranks {ranks}"

        return what

    def _as_bytes_if_needed(self, op: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.support(op, tensors[0].dtype) is Support.FALLBACK:
            return tuple(_as_bytes(t) for t in tensors)
        return tensors

    def _finish(self, work, epilogue, async_op, op: str = "collective", group=None):
        if async_op:
            return Handle(work, epilogue, self._describe(op, group), self.timeout_s)
        if epilogue is not None:
            epilogue()
        return None

    def _sync(self, op: str, group):
        """Wraps a blocking call: a timeout becomes a CollectiveTimeout naming it."""
        return _named(self._describe(op, group), self.timeout_s)


class _Chained:
    """A torch Work followed by a local step, exposed with Work's interface."""

    def __init__(self, work, then: Callable[[], object]):
        self._work, self._then = work, then

    def wait(self):
        self._work.wait()
        self._then()

    def is_completed(self):
        return self._work.is_completed()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as uint8, with ``t``'s leading dims kept: a multi-byte dtype (bf16)
    gets a trailing byte dim, so dim-0 splits (all-to-all) and shapes still line up."""
    if t.element_size() == 1:
        return t.view(torch.uint8)
    return t.unsqueeze(-1).view(torch.uint8)


def _reduce_op(op: str):
    try:
        return _REDUCE_OPS[op]
    except KeyError:
        raise ValueError(f"unknown reduce op {op!r}; known: {', '.join(_REDUCE_OPS)}") from None


def _check_shard(shard: torch.Tensor, full: torch.Tensor, size: int, op: str) -> None:
    if full.numel() != shard.numel() * size:
        raise ValueError(
            f"{op}: full tensor has {full.numel()} elements, expected shard "
            f"({shard.numel()}) x group size ({size}) = {shard.numel() * size}"
        )
