"""An ``Engine``'s model and optimizer state as logical tensors, and back.

Saving: each rank offers its pieces (``logical``) of every parameter it owns,
named ``model.<name>``; ``optim.exp_avg.<name>``, ``optim.exp_avg_sq.<name>``
and, for low-precision params, ``optim.master.<name>`` in the same shape;
persistent model buffers as ``model.<name>`` (replicated over tp). DCP writes
each distinct rectangle once (dp replicas are deduplicated).

ZeRO-1 shards live as flat ranges of the gradient buffers, which are not
rectangles of the parameters. At save every dp rank all-gathers the optimizer
state of each bucket (exact copies, no arithmetic): a transient 2-3 fp32 copies
of this rank's (tp/pp-sharded) parameters. At load every rank reads its
parameters' full state and keeps the range it owns, so a ZeRO-1 checkpoint
loads under any dp size, with or without ZeRO.

ZeRO-3 blocks hold only their shard of the params between uses: save and load gather
them whole (``DataParallel.gathered_params``); a save copies them, as the writer may
read its tensors after the gathered params are freed, and a load writes back into
the shards.

A tied copy on another pipeline stage (a parameter not in the chunk's
``own_parameter_names``, e.g. GPT's ``output.weight`` on the last stage) is not
saved: it loads from its twin (``ModelFamily.checkpoint_aliases``), state included.

Mixture-of-experts expert weights are split over ep along their experts dim
(``named_expert_parameters``) on top of tp: each rank offers its ep x tp
rectangle of the whole ``[E, ...]`` logical tensor (see ``logical``); the edp
replicas offer the same rectangle, written once. Their ZeRO-1 state is sharded
over ``edp`` rather than ``dp_cp`` (``DataParallel.reduction_of``), which the
gather above follows bucket by bucket.

Under LoRA (``finetune.lora``) a part is picked: ``"adapters"`` (the trainable
parameters, the only ones a LoRA checkpoint holds, with their optimizer state) or
``"base"`` (the frozen ones, loaded from the base checkpoint); ``"all"`` otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mtcore.parallel.layout import Axis
from mtcore.parallel.moe import named_expert_parameters
from mtcore.parallel.tensor import named_tp_parameters
from mtcore.training.checkpoint.logical import (
    Piece,
    join_pieces,
    section_entry,
    split_pieces,
    to_logical,
)
from mtcore.training.checkpoint.manifest import CheckpointError

KINDS = ("exp_avg", "exp_avg_sq", "master")
PARTS = ("all", "adapters", "base")


def _in_part(param: Tensor, part: str) -> bool:
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    return part == "all" or param.requires_grad == (part == "adapters")


class _Param:
    def __init__(self, name, param, partition, saved: bool, aliases, expert_dim=None):
        self.name, self.param, self.partition = name, param, partition
        self.expert_dim = expert_dim  # the dim split over ep (expert weights), else None
        self.saved = saved
        if not saved and name not in aliases:
            raise CheckpointError(
                f"parameter {name!r} is a tied copy but the model family names no twin for "
                "it (ModelFamily.checkpoint_aliases)"
            )
        self.source = name if saved else aliases[name]


class EngineState:
    """The mapping between one rank's engine and the checkpoint's logical tensors."""

    def __init__(self, engine):
        layout = engine.layout
        self.engine, self.layout = engine, layout
        self.tp, self.ep = layout.tp, layout.ep
        self.params: list[_Param] = []
        self.buffers: dict[str, Tensor] = {}
        self._chunk_of: dict[str, object] = {}
        aliases = engine.family.checkpoint_aliases
        for chunk in engine.chunks:
            experts = {name: dim for name, _, (dim, _) in named_expert_parameters(chunk)}
            own = set(chunk.own_parameter_names())
            for name, p, partition, _ in named_tp_parameters(chunk):
                entry = _Param(name, p, partition, name in own, aliases, experts.get(name))
                self.params.append(entry)
            names = {n for n, _ in chunk.named_parameters()}
            for name, value in chunk.state_dict(keep_vars=True).items():
                if name not in names and isinstance(value, Tensor):
                    self.buffers[name] = value
                    self._chunk_of[name] = chunk
        self._meshes: dict[tuple[str, ...], object] = {}
        ddp = engine.ddp
        self._zero3 = {id(p) for buf in ddp.grad_buffers if buf.shard_params for p in buf.params}

    # -- shapes and records ----------------------------------------------------------
    def sections(self) -> dict[str, dict]:
        """This rank's multi-section parameters, for the manifest."""
        out = {}
        for entry in self.params:
            record = section_entry(entry.partition)
            if record is not None:
                out[entry.source] = record
        return out

    def mesh(self, axes: tuple[str, ...]):
        """The DeviceMesh over ``axes`` (("tp",), ("ep",) or ("ep", "tp")) through this
        rank, built from the layout's existing groups (no new process group)."""
        if axes not in self._meshes:
            from torch.distributed.device_mesh import DeviceMesh

            device_type = self.engine.backend.device.type
            if len(axes) == 1:
                mesh = DeviceMesh.from_group(self.layout.group(axes[0]), device_type)
            else:
                # Every ep peer has this rank's tp coordinate (tp is the fastest axis):
                # its tp group is the tp consecutive ranks from r - r % tp.
                tp = self.tp
                grid = [[r - r % tp + i for i in range(tp)] for r in self.layout.ranks_of[Axis.EP]]
                if grid[self.layout.coordinate(Axis.EP)] != list(self.layout.ranks_of[Axis.TP]):
                    raise CheckpointError(
                        f"rank {self.layout.rank}: its tp group {self.layout.ranks_of['tp']} is "
                        f"not a row of the ep x tp grid {grid} (rank order changed?)"
                    )
                groups = [self.layout.group(axis) for axis in axes]
                mesh = DeviceMesh.from_group(groups, device_type, grid, mesh_dim_names=axes)
            self._meshes[axes] = mesh
        return self._meshes[axes]

    def _pieces(self, entry: _Param, local: Tensor, prefix: str) -> list[Piece]:
        pieces = split_pieces(entry.source, local, entry.partition, self.tp, entry.expert_dim)
        for piece in pieces:
            piece.key = f"{prefix}.{piece.key}"
        return pieces

    def _logical(self, piece: Piece) -> Tensor:
        return to_logical(piece, self.tp, self.ep, self.mesh)

    # -- save ---------------------------------------------------------------------------
    @torch.no_grad()
    def save_tensors(self, optimizer: bool = True, part: str = "all") -> dict[str, Tensor]:
        """Every logical tensor this rank contributes (of ``part``'s parameters).
        Collective over dp under ZeRO-1."""
        out: dict[str, Tensor] = {}
        with self.engine.ddp.gathered_params():
            for entry in self.params:
                if entry.saved and _in_part(entry.param, part):
                    local = entry.param.detach()
                    if id(entry.param) in self._zero3:  # freed when the gather ends
                        local = local.clone()
                    for piece in self._pieces(entry, local, "model"):
                        out[piece.key] = self._logical(piece)
        for name, value in self.buffers.items():
            out[f"model.{name}"] = value.detach()
        if optimizer:
            flat = self._gather_optimizer_state()
            for entry in self.params:
                if not entry.saved or not entry.param.requires_grad:
                    continue
                for kind, local in self._param_state(entry, flat).items():
                    for piece in self._pieces(entry, local, f"optim.{kind}"):
                        out[piece.key] = self._logical(piece)
            for name, tensor in self._rank_state().items():
                out[self._rank_key(name)] = tensor.detach()
        return out

    # -- per-rank optimizer state (1-bit Adam's error feedback) --------------------------
    def _rank_state(self) -> dict[str, Tensor]:
        """Optimizer state that differs between ranks and has no logical form (1-bit
        Adam's worker and server error buffers), saved under this rank's own keys."""
        rank_state = getattr(self.engine.optimizer, "rank_state", None)
        return rank_state() if rank_state is not None else {}

    def _rank_key(self, name: str) -> str:
        return f"optim.rank{self.layout.rank}.{name}"

    def _gather_optimizer_state(self) -> dict[str, dict[int, Tensor]]:
        """``kind -> id(buffer) -> flat fp32 state of the whole buffer`` on every dp rank."""
        opt, ddp = self.engine.optimizer, self.engine.ddp
        flat: dict[str, dict[int, Tensor]] = {kind: {} for kind in KINDS}
        for seg in opt.segments:
            buf = seg.buffer
            separate_master = seg.master.data_ptr() != seg.param_data.data_ptr()
            for kind in KINDS:
                if kind == "master" and not separate_master:
                    continue
                t = flat[kind].setdefault(id(buf), torch.zeros(buf.numel, device=buf.device))
                t[seg.start : seg.end].copy_(getattr(seg, kind))
        if opt.sharded:
            handles = []
            for kind in KINDS:
                for buf in ddp.grad_buffers:
                    t = flat[kind].get(id(buf))
                    if t is None:
                        continue
                    for bucket in buf.buckets:
                        group, size, rank = ddp.reduction_of(bucket)  # dp_cp; edp for experts
                        if size == 1:
                            continue
                        lo, hi = bucket.shard(rank, size)
                        out = t[bucket.start : bucket.end]
                        handles.append(
                            ddp.collective.all_gather(
                                out, t[lo:hi].clone(), group=group, async_op=True
                            )
                        )
            for handle in handles:
                handle.wait()
        return flat

    def _param_state(self, entry: _Param, flat) -> dict[str, Tensor]:
        buf = self.engine.ddp.buffer_of(entry.param)
        start, end = buf.range_of(entry.param)
        return {
            kind: flat[kind][id(buf)][start:end].view_as(entry.param)
            for kind in KINDS
            if id(buf) in flat[kind]
        }

    # -- load ---------------------------------------------------------------------------
    def load_targets(
        self, available: dict, optimizer: bool, part: str = "all"
    ) -> tuple[dict[str, Tensor], Callable[[], None]]:
        """The tensors to hand ``dcp.load`` and the function that applies them afterwards.

        available: ``key -> (shape, dtype)`` of the checkpoint; a parameter of ``part``
        missing from it is an error naming it, as is a shape that does not fit this model.
        """
        targets: dict[str, Tensor] = {}
        plans: list[tuple[Callable[[Tensor], None], list[Piece]]] = []

        def want(pieces: list[Piece], apply: Callable[[Tensor], None], required=True) -> None:
            keys = [p.key for p in pieces]
            missing = [k for k in keys if k not in available]
            if missing:
                if required:
                    raise CheckpointError(f"the checkpoint has no tensor {missing[0]!r}")
                return
            for piece in pieces:
                piece.local = torch.empty_like(piece.local, memory_format=torch.contiguous_format)
                _check_shape(piece, self.tp, self.ep, available[piece.key][0])
                targets[piece.key] = self._logical(piece)
            plans.append((apply, pieces))

        flat: dict[str, dict[int, Tensor]] = self._empty_optimizer_state() if optimizer else {}
        # ZeRO-3: the pieces are cut from whole params (only their shapes are kept).
        with self.engine.ddp.gathered_params():
            for entry in self.params:
                if not _in_part(entry.param, part):
                    continue
                state = {}
                if optimizer and entry.param.requires_grad:
                    state = self._param_state(entry, flat)
                masters = self._pieces(entry, entry.param.detach(), "optim.master")
                saved_masters = all(p.key in available for p in masters)
                if "master" in state and not saved_masters:
                    # An fp32 checkpoint in a low-precision run: its params are the masters.
                    master, param = state.pop("master"), entry.param
                    apply_both = lambda t, m=master, p=param: (m.copy_(t), p.data.copy_(t))  # noqa: E731
                    want(self._pieces(entry, master, "model"), apply_both)
                elif "master" not in state and saved_masters:
                    # A low-precision checkpoint in an fp32 run: the weights are its fp32 masters
                    # (its params are their rounded copies).
                    want(masters, entry.param.data.copy_)
                else:
                    want(self._pieces(entry, entry.param.detach(), "model"), entry.param.data.copy_)
                for kind, local in state.items():
                    want(self._pieces(entry, local, f"optim.{kind}"), local.copy_)
        for name, value in self.buffers.items():
            # Through load_state_dict, so a module's own load hook sees its state (FP8
            # scaling derives its "fresh" flags from the loaded amax history).
            chunk = self._chunk_of[name]
            load = lambda t, c=chunk, n=name: c.load_state_dict({n: t}, strict=False)  # noqa: E731
            want([Piece(f"model.{name}", value.detach(), None)], load, required=False)

        # Per-rank state is restored when this rank saved it with the same shapes (the same
        # layout); otherwise it starts at zero, which is a valid (if less exact) state.
        rank_targets: dict[str, Tensor] = {}
        if optimizer:
            for name, tensor in self._rank_state().items():
                key = self._rank_key(name)
                if key in available and tuple(available[key][0]) == tuple(tensor.shape):
                    rank_targets[name] = targets[key] = torch.empty_like(tensor)

        def apply() -> None:
            with torch.no_grad():
                with self.engine.ddp.gathered_params(write_back=True):
                    for fn, pieces in plans:
                        fn(join_pieces([p.local for p in pieces], pieces[0].dim))
                self._install_optimizer_state(flat)
                if rank_targets and len(rank_targets) == len(self._rank_state()):
                    self.engine.optimizer.load_rank_state(rank_targets)

        return targets, apply

    def _empty_optimizer_state(self) -> dict[str, dict[int, Tensor]]:
        flat: dict[str, dict[int, Tensor]] = {kind: {} for kind in KINDS}
        for seg in self.engine.optimizer.segments:
            buf = seg.buffer
            separate_master = seg.master.data_ptr() != seg.param_data.data_ptr()
            for kind in KINDS:
                if kind != "master" or separate_master:
                    flat[kind].setdefault(id(buf), torch.zeros(buf.numel, device=buf.device))
        return flat

    def _install_optimizer_state(self, flat: dict[str, dict[int, Tensor]]) -> None:
        """Keep the owned ranges of the loaded full state; without one (weights only) start
        the moments at zero and the master weights from the loaded params."""
        opt = self.engine.optimizer
        for seg in opt.segments:
            for kind in KINDS:
                mine = getattr(seg, kind)
                source = flat.get(kind, {}).get(id(seg.buffer))
                if source is not None:
                    mine.copy_(source[seg.start : seg.end])
                elif kind == "master":
                    if mine.data_ptr() != seg.param_data.data_ptr():
                        mine.copy_(seg.param_data)
                else:
                    mine.zero_()


def _check_shape(piece: Piece, tp: int, ep: int, saved: torch.Size) -> None:
    shape = piece.global_shape(tp, ep)
    if list(saved) != shape:
        raise CheckpointError(
            f"checkpoint tensor {piece.key!r} has shape {list(saved)} but this model needs "
            f"{shape} (a different model config?)"
        )

