"""A checkpoint error seen by rank 0 alone must reach every rank as an error, not leave the
others waiting in a collective (a hang until the process-group timeout).

Two gloo ranks, a tiny dense GPT under dp=2:

* save into a root rank 0 cannot create (a regular file stands there);
* load a checkpoint whose manifest rank 0 cannot use for verification (an entry lacks
  its ``bytes``; not a CheckpointError inside the check itself);
* a save whose commit fails on rank 0 (a directory stands where ``latest.tmp`` goes),
  written synchronously or in the background (its commit fails in ``wait``).

And the converse: a choice rank 0 makes is every rank's. Loading a root while another
job commits into it (``checkpoint.load: runs/a/checkpoints`` of a live run) must load
one step on all ranks: here rank 1 commits step 3 after rank 0 has resolved ``latest``
(rank 1 sleeps first; were rank 0 slower still, both would pick step 3 and the check
passes anyway). Likewise whether ``resume`` finds a checkpoint is rank 0's answer.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from mtcore.models.gpt import GPTConfig
from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.testing.distributed import run_ranks
from mtcore.training.checkpoint import Checkpointer
from mtcore.training.checkpoint import manifest as mf
from mtcore.training.engine import Engine

MODEL = GPTConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=16
)


def _outcome(fn) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def _rank_main(ctx, root: str):
    root = Path(root)
    layout = ParallelLayout.build(LayoutSpec(), ctx.backend.collective, ctx.rank, ctx.world_size)
    engine = Engine(MODEL, layout, ctx.backend, micro_batch_size=1, num_microbatches=1)
    ck = Checkpointer(engine)
    out = {}
    blocked = root / "blocked"
    out["save_into_file"] = _outcome(lambda: ck.save(blocked, 1, {}, model_config=MODEL))

    good = root / "good"
    ck.save(good, 2, {}, model_config=MODEL)
    ctx.backend.collective.barrier()
    if ctx.rank == 0:
        manifest_path = good / "step_000002" / "manifest.json"
        manifest = json.loads(manifest_path.read_text())
        del manifest["files"][0]["bytes"]
        manifest_path.write_text(json.dumps(manifest))
    ctx.backend.collective.barrier()
    out["load_bad_manifest"] = _outcome(lambda: ck.load(good))

    if ctx.rank == 0:
        (root / "late" / "latest.tmp").mkdir(parents=True)
    ctx.backend.collective.barrier()
    out["commit_fails"] = _outcome(lambda: ck.save(root / "late", 3, {}, model_config=MODEL))

    background = Checkpointer(engine, async_save=True)
    background.save(root / "late", 4, {}, model_config=MODEL)
    out["async_commit_fails"] = _outcome(background.wait)

    live = root / "live"
    ck.save(live, 2, {}, model_config=MODEL)
    ctx.backend.collective.barrier()
    if ctx.rank == 1:  # another job commits step 3 while rank 0 is already loading
        time.sleep(2)
        staging = live / "step_000003.partial"
        shutil.copytree(live / "step_000002", staging)
        header = json.loads((staging / "manifest.json").read_text())
        (staging / "manifest.json").unlink()
        header = {k: v for k, v in header.items() if k not in ("format", "files")}
        mf.commit(staging, {**header, "step": 3})
    out["live_load"] = ck.load(live).directory.name
    # Whether to resume: rank 0's view is every rank's (here each rank looks at another
    # root, as ranks would whose file-system views disagree).
    out["latest"] = ck.latest_commit(good if ctx.rank == 0 else root / "empty")
    return out


def test_rank0_failures_raise_on_every_rank(tmp_path):
    (tmp_path / "blocked").write_text("not a directory")
    results = run_ranks(_rank_main, 2, str(tmp_path), timeout_s=90)
    for name in ("save_into_file", "load_bad_manifest", "commit_fails", "async_commit_fails"):
        for rank, out in enumerate(results):
            assert out[name] != "ok", (name, rank, out[name])
    assert "rank 0" in results[1]["save_into_file"]
    assert "blocked" in results[0]["save_into_file"]
    assert results[0]["live_load"] == results[1]["live_load"], results
    assert [out["latest"] for out in results] == [results[0]["latest"]] * 2
    assert results[0]["latest"] is not None  # rank 0 sees a commit (its manifest damaged)
