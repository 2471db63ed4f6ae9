"""The trainer's side of checkpoints: where to start from, what to save, what to report.

``checkpoint.load`` names a checkpoint to start from (a step directory, or a
root: its latest committed step); ``checkpoint.resume`` continues from
``checkpoint.dir`` when it holds one (the restart of a preempted job), and
starts fresh otherwise; ``checkpoint.finetune`` takes the weights only. A
weights-only checkpoint (``write_model_weights``, ``mtcore convert``) always
starts at step 0 with a fresh optimizer.

An elastic job resumes by itself: when ``checkpoint.dir``'s latest commit was
written by the same run (``training.elastic``: the rendezvous id), a restarted
rank, a replacement node or a requeued job continues from it whatever
``checkpoint.resume`` says; a commit of another run is resumed only when asked.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from mtcore.data import DataError
from mtcore.training.checkpoint.checkpointer import Checkpointer
from mtcore.training.checkpoint.lineage import decide, fingerprint
from mtcore.training.checkpoint.manifest import MANIFEST, CheckpointError, partial_dirs
from mtcore.training.elastic import ElasticRun


class TrainerCheckpoints:
    """Save/restore for ``trainer._Loop``: every rank makes the same calls."""

    def __init__(
        self,
        config,
        engine,
        prep,
        say,
        owner=None,
        elastic: ElasticRun | None = None,
        run_fingerprint: str | None = None,
    ):
        self.config, self.ck, self.say = config, config.checkpoint, say
        self.fingerprint = run_fingerprint or fingerprint(config)
        self.tokenizer, self.model_config = prep.data.tokenizer, prep.model
        self.elastic = elastic or ElasticRun()
        self.checkpointer = None
        if self.ck.dir is not None or self.ck.load is not None:
            self.checkpointer = Checkpointer(
                engine,
                keep_last=self.ck.keep_last,
                async_save=self.ck.async_save,
                owner=owner,
                run_id=self.elastic.run_id,
            )

    def restore(self, loader) -> int:
        """Load the configured checkpoint into the engine and ``loader``; the step to
        continue after (0: from the start).

        ``resume`` with a checkpoint in ``dir`` wins over ``load``: a restarted fine-tuning
        job continues from its own last save, not from the model it started from.
        """
        if self.checkpointer is None:
            return 0
        path, finetune = self.ck.load, self.ck.finetune
        if self.ck.dir is not None:
            root = Path(self.ck.dir).expanduser()
            latest = self.checkpointer.latest_commit(root)  # collective: rank 0 decides
            ours = latest is not None and self._our_run(latest)
            # Every rank decides alike (rank 0's view of the root), refusal included.
            start = decide(self.config, latest, self.elastic.run_id, self.fingerprint)
            self.checkpointer.lineage = start.lineage
            self.checkpointer.overwrite = self.ck.overwrite and not start.resume
            self._say_restart(latest, ours, start.resume)
            if start.note:
                self.say(start.note)
            if start.resume or self.ck.resume:
                self._report_partials(root)
                if latest is not None:
                    path, finetune = str(root), False
                elif path is None and self.ck.resume:
                    self.say(f"checkpoint: nothing to resume under {root}; starting at step 0")
        if path is None:
            return 0
        given = Path(path).expanduser()
        self._report_partials(given.parent if (given / MANIFEST).is_file() else given)
        loaded = self.checkpointer.load(path, finetune=finetune)
        if loaded.trainer_state is not None:
            try:
                loader.load_state_dict(loaded.trainer_state["data"])
            except DataError as e:  # a changed seed or data: the saved position means nothing
                raise CheckpointError(f"{loaded.directory}: {e}") from e
        for note in loaded.notes:
            self.say(f"checkpoint: {note} (differs from the checkpoint's model)")
        if loaded.step == 0:
            self.say(f"checkpoint: model weights from {loaded.directory}; fresh optimizer, step 0")
        else:
            rng = "restored" if loaded.rng else "reseeded (the layout changed)"
            moved = f", resharded from {loaded.resharded}" if loaded.resharded else ""
            self.say(
                f"checkpoint: resumed from {loaded.directory} at step {loaded.step}{moved} "
                f"(optimizer, data position; RNG streams {rng})"
            )
        return loaded.step

    def _our_run(self, latest: dict) -> bool:
        run_id = self.elastic.run_id
        return run_id is not None and latest.get("run_id") == run_id

    def _say_restart(self, latest: dict | None, ours: bool, resume: bool) -> None:
        """One line when the agent restarted this rank, or when a new agent (a replacement
        node, a requeued job) finds its own run's commit."""
        run = self.elastic
        what = "resuming from checkpoint.dir's latest commit"
        if not resume:
            what = "no commit of this run yet: starting at step 0"
        if run.restart > 0:
            most = run.max_restarts if run.max_restarts is not None else "?"
            self.say(f"mtcore train: restart {run.restart} of at most {most} (a rank stopped or a node was lost): {what}")
        elif ours and not self.ck.resume:
            self.say(
                f"checkpoint: the latest commit (step {latest['step']}) is this run's "
                f"({run.run_id}): resuming it"
            )

    def save(self, step: int, loader, final: bool = False) -> Path | None:
        """Save ``step`` (collective); the committed directory on rank 0 once it is."""
        if self.checkpointer is None or self.ck.dir is None:
            return None
        files = {
            "tokenizer.json": self.tokenizer.hf.to_str().encode(),
            "config.yaml": yaml.safe_dump(
                self.config.model_dump(mode="json"), sort_keys=False
            ).encode(),
        }
        if getattr(self.tokenizer, "chat_config", None):  # a chat template: it travels along
            files["tokenizer_config.json"] = json.dumps(self.tokenizer.chat_config).encode()
        state = {"data": loader.state_dict()}
        done = self.checkpointer.save(self.ck.dir, step, state, files, self.model_config)
        if final:
            done = self.checkpointer.wait() or done
        self._say_done(done)
        return done

    def _say_done(self, done: Path | None) -> None:
        if done is not None:
            self.say(f"checkpoint: {done}")
        if removed := self.checkpointer.removed_others:  # rank 0, after --checkpoint.overwrite
            self.say(f"checkpoint: removed the earlier run's steps {_spans(removed)} (--checkpoint.overwrite)")
            self.checkpointer.removed_others = []

    def poll(self) -> Path | None:
        """Commit a finished asynchronous save (call once per step)."""
        if self.checkpointer is None:
            return None
        done = self.checkpointer.poll()
        self._say_done(done)
        return done

    def _report_partials(self, root: Path) -> None:
        if root.is_dir():
            for path in partial_dirs(root):
                self.say(
                    f"checkpoint: ignoring incomplete checkpoint {path} (the save never committed)"
                )


def _spans(steps: list[int]) -> str:
    """``1-3, 7`` for [1, 2, 3, 7]."""
    from mtcore.training.elastic import _spans as spans

    return spans(steps)
