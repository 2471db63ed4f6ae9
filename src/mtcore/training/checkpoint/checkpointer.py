"""Save and load the whole training state of every rank through torch.distributed.checkpoint.

What a training checkpoint ``<root>/step_<N>/`` holds:

* DCP files (``.metadata``, ``__<rank>_0.distcp``): the logical tensors of
  ``EngineState`` (model, optimizer, buffers) and every rank's RNG states
  (``rng.rank<r>.host``/``.device``/``.tracker.<stream>``);
* ``trainer_state.json``: step, optimizer step count and hyper-parameters, loss
  scaler, data loader position, plus whatever the trainer adds (plain JSON:
  nothing here is unpickled on load);
* ``manifest.json`` (written last, see ``manifest``), and the trainer's extra
  files (``tokenizer.json``, ``config.yaml``).

Under LoRA (``engine.lora``) the tensors are the adapters' alone and the manifest's
``lora`` names the adapters' config and the base checkpoint (``lora_base``); loading
such a checkpoint loads that base first. Loading a plain checkpoint into a LoRA engine
takes its weights as the base (weights only, step 0).

Asynchronous save (``async_save=True``): the state is copied during the call
(``host_copy``: to host memory, DTensor pieces on their own device), then
written by a background thread over a separate gloo process group, so it never
interleaves with the training collectives; rank 0 commits it when it finishes
(``poll`` at each step, ``wait`` at the end).

A save that fails because the file system is full (or over quota) raises one
``CheckpointWriteError`` on every rank, naming the step, the directory and the
last complete checkpoint; rank 0 removes the incomplete save, and the committed
checkpoints are untouched.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from mtcore.training.checkpoint import manifest as mf
from mtcore.training.checkpoint.compat import check_model_matches
from mtcore.training.checkpoint.engine_state import EngineState
from mtcore.training.checkpoint.lineage import check_commit, latest_commit, remove_other_lineages
from mtcore.training.checkpoint.lora_base import init_reference, lora_part
from mtcore.training.checkpoint.safe_reader import dcp_load, dcp_save, tensor_shapes

TRAINER_STATE = "trainer_state.json"
# Fault injection for the kill test: rank 0 sleeps this long between writing a save and
# committing it, so a test can kill the job while the .partial directory exists.
COMMIT_DELAY_ENV = "MTCORE_CHECKPOINT_COMMIT_DELAY_S"

_FULL_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
# torch's writers report a short write as "unexpected pos 704 vs 598", without an errno.
_FULL_MESSAGES = {
    "No space left on device": "no space left on device",
    "Disk quota exceeded": "disk quota exceeded",
    "unexpected pos": "no space left on device",
}


class CheckpointWriteError(mf.CheckpointError):
    """A save ran out of disk space; the message names the step, the directory and the last
    complete checkpoint, which the failed save left intact."""


@dataclass
class Loaded:
    """What ``Checkpointer.load`` restored. step: where training continues (0 for a
    weights-only or finetune load); trainer_state: the JSON the trainer saved (None
    without one); rng: whether every RNG stream was restored (same layout only)."""

    directory: Path
    step: int
    trainer_state: dict | None
    rng: bool
    kind: str
    notes: tuple[str, ...] = ()  # numerics-only differences from the checkpoint's model
    resharded: str | None = None  # "4 ranks (dp=2) -> 2 ranks (dp=1)" when the layout changed


def describe_reshard(saved: dict | None, now: dict) -> str | None:
    """How the layout that saved a checkpoint differs from ``now`` (``Checkpointer``'s layout
    records), e.g. ``4 ranks (dp=2) -> 2 ranks (dp=1)``; None when they are equal or the
    checkpoint recorded none (weights only)."""
    if not isinstance(saved, dict) or saved == now:
        return None
    keys = [k for k in {**saved, **now} if k != "world_size" and saved.get(k) != now.get(k)]
    before = ", ".join(f"{k}={saved.get(k)}" for k in keys)
    after = ", ".join(f"{k}={now.get(k)}" for k in keys)
    return f"{saved.get('world_size', '?')} ranks ({before}) -> {now['world_size']} ranks ({after})"


class Checkpointer:
    """One per rank. ``save``/``load`` are collective: call them on every rank."""

    def __init__(
        self,
        engine,
        *,
        keep_last: int = 0,
        async_save: bool = False,
        owner=None,
        run_id: str | None = None,
    ):
        """``owner``: the job's ``owner.Ownership`` of the root it saves into (its
        incarnation names the staging directories; rank 0 asks its fence before every
        commit); ``run_id``: the elastic job's id, recorded in every manifest."""
        self.engine, self.layout = engine, engine.layout
        self.owner, self.run_id = owner, run_id
        # The run this one continues or starts (``lineage``), set once it has started;
        # ``overwrite``: its first commit removes the other runs' steps (rank 0).
        self.lineage: dict | None = None
        self.overwrite = False
        self.removed_others: list[int] = []
        self.backend, self.collective = engine.backend, engine.collective
        self.rank, self.world = self.layout.rank, self.layout.world_size
        self.state = EngineState(engine)
        self.lora = getattr(engine, "lora", None)
        # The base a LoRA checkpoint refers to: the initialisation until a load says otherwise.
        self.base = init_reference(engine.seed) if self.lora is not None else None
        self.keep_last, self.async_save = keep_last, async_save
        self.layout_record = {
            **self.layout.spec.model_dump(mode="json"),
            "world_size": self.world,
            "zero1": bool(engine.optimizer.sharded),
        }
        if engine.ddp.config.shard_gradients:  # only then, so older records still compare equal
            self.layout_record["zero"] = 3 if engine.ddp.config.shard_params else 2
        self._sections: dict | None = None
        self._pending = None  # (future, staging, header) of an asynchronous save
        self._commit_error: Exception | None = None  # rank 0's failed commit in poll()
        self._group = None
        if async_save and self.world > 1:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")  # every rank, now, in the same order

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- save ---------------------------------------------------------------------------
    def save(
        self,
        root: str | Path,
        step: int,
        trainer_state: dict,
        files: dict[str, bytes] | None = None,
        model_config=None,
    ) -> Path | None:
        """Write step ``step``; returns the committed directory (None on other ranks, or
        while an asynchronous save is still being written). ``model_config``: recorded in
        the manifest (None: the engine's)."""
        root = Path(root).expanduser()  # as resolve_checkpoint and has_checkpoint do
        self.wait()  # one save in flight at a time
        sections = self._gathered_sections()
        part = "all" if self.lora is None else "adapters"
        tensors = self.state.save_tensors(optimizer=True, part=part)  # collective under ZeRO-1
        tensors.update(self._rng_tensors())
        incarnation = self.owner.incarnation if self.owner is not None else None
        staging = mf.staging_dir(root, step, incarnation)
        error = None
        if self.is_main:
            try:
                self._prepare(staging, root, step, trainer_state, files)
            except Exception as e:
                error = self._disk_full_error(e, staging, step) or e
        # Also the barrier: no rank writes into staging before rank 0 has created it.
        self._settle(error, f"prepare {staging}")
        header = {
            "step": step,
            "kind": "training",
            "layout": self.layout_record,
            # load() refuses a checkpoint without one: default to the engine's model.
            "model_config": (model_config or self.engine.config).model_dump(mode="json"),
            "sections": sections,
            "run": {"id": self.run_id, "incarnation": incarnation},
        }
        if self.lineage is not None:
            header["lineage"] = self.lineage
        if self.lora is not None:
            header["lora"] = {"config": self.lora.model_dump(mode="json"), "base": self.base}
        if self.async_save:
            future = dcp_save(
                host_copy(tensors),
                staging,
                self.world,
                run_async=True,
                process_group=self._group,
            )
            self._pending = (future, staging, header)
            return None
        try:
            dcp_save(tensors, staging, self.world)
        except (Exception, CheckpointException) as e:  # DCP's own error is a BaseException
            full = self._disk_full_error(e, staging, step)
            if full is None:
                raise
            raise full from e
        return self._commit(staging, header, collective=True)

    def _prepare(self, staging, root, step, trainer_state, files) -> None:
        """Rank 0: the staging directory with the trainer's JSON and extra files."""
        mf.begin(root, step, self.owner.incarnation if self.owner is not None else None)
        opt = self.engine.optimizer
        state = {
            "step": step,
            "optimizer": {
                "step_count": opt.step_count,
                "param_groups": [
                    {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups
                ],
            },
            "loss_scaler": opt.loss_scaler.state_dict() if opt.loss_scaler else None,
            **trainer_state,
        }
        mf.write_json_atomic(staging / TRAINER_STATE, state)
        for name, data in (files or {}).items():
            (staging / name).write_bytes(data)

    def poll(self) -> Path | None:
        """Commit an asynchronous save that has finished; its directory (rank 0) or None.
        Not collective (ranks see the write finish at different steps): a failed commit on
        rank 0 is kept and raised on every rank by the next ``save``/``wait``."""
        if self._pending is None or not self._pending[0].done():
            return None
        return self._finish(collective=False)

    def wait(self) -> Path | None:
        """Finish and commit the asynchronous save in flight, if any. Collective."""
        return self._finish(collective=True)

    def _finish(self, collective: bool) -> Path | None:
        done = None
        if self._pending is not None:
            future, staging, header = self._pending
            self._pending = None
            try:
                future.result()  # re-raises a failed write (on every rank: DCP gathers errors)
            except (Exception, CheckpointException) as e:
                full = self._disk_full_error(e, staging, header["step"])
                if full is None:
                    raise
                raise full from e
            done = self._commit(staging, header, collective=False)
        if collective:
            error, self._commit_error = self._commit_error, None
            self._settle(error, "commit the asynchronous save")
        return done

    def _commit(self, staging: Path, header: dict, collective: bool) -> Path | None:
        """Rank 0 commits. ``collective``: every rank learns whether it did (an error
        raises everywhere); otherwise rank 0's error waits for the next ``wait``."""
        done, error = None, None
        if self.is_main:
            try:
                delay = float(os.environ.get(COMMIT_DELAY_ENV, "0") or 0)
                if delay > 0:
                    time.sleep(delay)
                if self.owner is not None and (left_behind := self.owner.fence()):
                    raise mf.CheckpointError(f"not committing step {header['step']}: {left_behind}")
                root, lineage = staging.parent, header.get("lineage")
                check_commit(root, header["step"], lineage, self.overwrite)
                done = mf.commit(staging, header, self.keep_last)
                if self.overwrite and lineage is not None:  # once: only this run's are left
                    self.removed_others = remove_other_lineages(root, lineage)
                    self.overwrite = False
            except Exception as e:
                error = self._disk_full_error(e, staging, header["step"]) or e
        if collective:
            self._settle(error, f"commit {staging}")
        elif error is not None:
            self._commit_error = error
        return done

    def _disk_full_error(self, error: BaseException, staging: Path, step: int):
        """A one-line ``CheckpointWriteError`` when ``error`` is a full disk, else None.
        Every rank that saw the failure calls this once its writes are over; rank 0 removes
        the incomplete save, which only takes space."""
        what = disk_full(error)
        if what is None:
            return None
        root = staging.parent
        if self.is_main:
            shutil.rmtree(staging, ignore_errors=True)
        steps = mf.committed_steps(root)
        last = f"step {steps[-1][0]} is" if steps else "there is no"
        full = CheckpointWriteError(
            f"{what} while saving step {step} to {root}; {last} the last complete checkpoint"
        )
        full.__cause__ = error
        return full

    def _settle(self, error: Exception | None, what: str) -> None:
        """Rank 0's outcome of a step only it performs, on every rank (a broadcast, so also
        a barrier): rank 0 re-raises its error and the others raise a CheckpointError, so
        no rank is left waiting in a collective that a failed rank 0 never joins."""
        if self.world > 1:
            flag = torch.tensor([1.0 if error else 0.0], device=self.engine.ddp.device)
            self.collective.broadcast(flag, src=0)
            if flag.item() and error is None:
                raise mf.CheckpointError(f"rank 0 failed to {what} (see rank 0's error)")
        if error is not None:
            raise error

    def _rng_tensors(self) -> dict[str, torch.Tensor]:
        prefix = f"rng.rank{self.rank}"
        out = {f"{prefix}.host": torch.get_rng_state()}
        device = self.backend.device
        if device.type != "cpu":
            out[f"{prefix}.device"] = device.get_rng_state().cpu()
        tracker = self.engine.rng_tracker
        for name, state in tracker.get_states().items():
            out[f"{prefix}.tracker.{name}"] = state.cpu()
        return out

    def _gathered_sections(self) -> dict:
        if self._sections is None:
            self._sections = gather_json(
                self.state.sections(), self.collective, self.world, self.engine.ddp.device
            )
        return self._sections

    # -- load ---------------------------------------------------------------------------
    def load(self, path: str | Path, finetune: bool = False) -> Loaded:
        """Restore from ``path`` (a root: its latest committed step). A weights-only
        checkpoint, or ``finetune``, loads the model only: fresh optimizer, step 0."""
        directory = self._resolve_on_rank0(path)
        self._verify_on_rank0(directory)
        manifest = mf.read_manifest(directory)
        notes = check_model_matches(manifest.get("model_config"), self.engine.config, directory)
        available = tensor_shapes(directory)
        full = manifest.get("kind") == "training" and not finetune
        part = lora_part(self, directory, manifest)
        if part == "base":  # a plain checkpoint under LoRA: the frozen weights, nothing else
            full = False
        targets, apply = self.state.load_targets(available, optimizer=full, part=part)
        rng_targets = {}
        same_layout = manifest.get("layout") == self.layout_record
        if full and same_layout:
            rng_targets = {k: v.clone() for k, v in self._rng_tensors().items()}
            if not all(k in available for k in rng_targets):
                rng_targets = {}
        dcp_load({**targets, **rng_targets}, directory, self.world)
        apply()
        trainer_state = None
        step = 0
        if full:
            path = directory / TRAINER_STATE
            try:  # checksummed, so damage here is a forged or hand-edited file
                trainer_state = json.loads(path.read_text(encoding="utf-8"))
                step = int(trainer_state["step"])
                self._restore_optimizer_scalars(trainer_state)
            except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
                raise mf.CheckpointError(f"{path} is malformed: {e!r}") from None
            if rng_targets:
                self._restore_rng(rng_targets)
        kind = manifest.get("kind", "?")
        resharded = describe_reshard(manifest.get("layout"), self.layout_record)
        return Loaded(
            directory, step, trainer_state, bool(rng_targets), kind, tuple(notes), resharded
        )

    def latest_commit(self, root: str | Path) -> dict | None:
        """``lineage.latest_commit`` (step, run id, kind, lineage) of ``root`` as
        rank 0 sees it, on every rank (collective; None: it holds none): ranks that judged it
        from their own view of a shared file system could split between resuming and
        starting fresh, and hang in different collectives."""
        found = {"latest": latest_commit(root)} if self.is_main else {}
        return gather_json(found, self.collective, self.world, self.engine.ddp.device)["latest"]

    def _resolve_on_rank0(self, path: str | Path) -> Path:
        """Rank 0 picks the step directory and every rank loads that one: a root's
        ``latest`` moves when the job that owns it commits, and ranks resolving it a moment
        apart would load different steps."""
        error, found = None, {}
        if self.is_main:
            try:
                found = {"directory": str(mf.resolve_checkpoint(path))}
            except Exception as e:
                error = e
        self._settle(error, f"resolve checkpoint {path}")
        found = gather_json(found, self.collective, self.world, self.engine.ddp.device)
        return Path(found["directory"])

    def _verify_on_rank0(self, directory: Path) -> None:
        """Rank 0 checks every checksum; the others wait for its verdict."""
        error = None
        if self.is_main:
            try:
                mf.verify_files(directory, mf.read_manifest(directory))
            except mf.CheckpointError as e:
                error = e
            except Exception as e:  # a malformed manifest entry, an unreadable file
                error = mf.CheckpointError(f"cannot verify checkpoint {directory}: {e!r}")
        self._settle(error, f"verify checkpoint {directory} (it rejected it)")

    def _restore_optimizer_scalars(self, state: dict) -> None:
        opt = self.engine.optimizer
        opt.step_count = int(state["optimizer"]["step_count"])
        for group, saved in zip(opt.param_groups, state["optimizer"]["param_groups"], strict=False):
            group.update({k: v for k, v in saved.items() if k in ("lr", "weight_decay")})
        if opt.loss_scaler is not None and state.get("loss_scaler"):
            opt.loss_scaler.load_state_dict(state["loss_scaler"])

    def _restore_rng(self, states: dict[str, torch.Tensor]) -> None:
        prefix = f"rng.rank{self.rank}"
        torch.set_rng_state(states[f"{prefix}.host"])
        if f"{prefix}.device" in states:
            self.backend.device.set_rng_state(states[f"{prefix}.device"])
        tracker = self.engine.rng_tracker
        tracker.set_states(
            {
                k.removeprefix(f"{prefix}.tracker."): v
                for k, v in states.items()
                if k.startswith(f"{prefix}.tracker.")
            }
        )


def gather_json(obj: dict, collective, world: int, device) -> dict:
    """The union of every rank's dict (plain JSON), on every rank: an all-gather of bytes."""
    if world == 1:
        return dict(obj)
    data = json.dumps(obj, sort_keys=True).encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    collective.all_gather(sizes, size)
    sizes = sizes.cpu()
    longest = int(sizes.max())
    mine = torch.zeros(longest, dtype=torch.int32)
    mine[: len(data)] = torch.tensor(list(data), dtype=torch.int32)
    every = torch.zeros(world * longest, dtype=torch.int32, device=device)
    collective.all_gather(every, mine.to(device))
    every = every.cpu()
    out: dict = {}
    for r in range(world):
        raw = bytes(every[r * longest : r * longest + int(sizes[r])].tolist())
        out.update(json.loads(raw.decode()))
    return out


def disk_full(error: BaseException) -> str | None:
    """What ran out ("no space left on device") if ``error``, or an error it wraps (DCP's
    per-rank failures, a cause, a context), is a full disk; else None."""
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return _FULL_ERRNOS[e.errno]
        if isinstance(e, CheckpointException):
            todo += [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        else:
            for text, what in _FULL_MESSAGES.items():
                if text in str(e):
                    return what
        todo += [e.__cause__, e.__context__]
    return None


def host_copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A host-memory snapshot of the tensors to save (DTensors stay DTensors). DCP's own
    stager deep-copies a DTensor, mesh and process group included, which fails."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in tensors.items():
        if isinstance(value, DTensor):
            local = value.to_local().detach().clone()  # stays on its mesh's device
            out[key] = DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        else:
            out[key] = value.detach().to("cpu", copy=True)
    return out
