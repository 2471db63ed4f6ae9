"""Pipeline parallelism: schedules as data, one runner, model splitting, tied weights.

``schedules`` builds per-rank action lists (no pipelining, GPipe, 1F1B,
interleaved 1F1B, zero-bubble ZB-H1 and its interleaved form); ``table`` holds one entry
per schedule (builder, virtual-stage rule, memory and bubble formulas) that the config,
the engine and the planner read; ``simulate`` checks and times them on paper; ``runner``
executes one rank's list over ``Collective.batch_send_recv``; ``split`` says
which layers each (rank, chunk) owns and validates batch sizes; ``groups``
holds the pipeline and tied-embedding groups.

Schedules, their simulation and the split are arithmetic, imported with the package (the
planner and config checks use them without torch); the runner, the groups and
``StageModule`` move tensors and are imported on first use.
"""

from mtcore import lazy_exports
from mtcore.parallel.pipeline.schedules import (
    Action,
    Schedule,
    ScheduleError,
    gpipe,
    interleaved_1f1b,
    interleaved_zb,
    no_pipelining,
    one_f_one_b,
    with_transfers,
    zb_h1,
)
from mtcore.parallel.pipeline.simulate import Timeline, simulate
from mtcore.parallel.pipeline.split import (
    SplitError,
    StagePlan,
    layer_counts,
    num_microbatches,
    stage_plan,
    stage_plans,
    validate_pipeline,
)
from mtcore.parallel.pipeline.table import (
    SCHEDULE_TABLE,
    ScheduleEntry,
    build_schedule,
    register_schedule,
    schedule_entry,
)

_WITH_TORCH = {
    "PipelineGroups": ".groups",
    "allreduce_tied_grads": ".groups",
    "sync_tied_weights": ".groups",
    "PipelineRunner": ".runner",
    "StepStats": ".runner",
    "TensorSpec": ".runner",
    "StageModule": ".stage_module",
}


__getattr__ = lazy_exports(__name__, _WITH_TORCH)


__all__ = [
    "SCHEDULE_TABLE",
    "Action",
    "PipelineGroups",
    "PipelineRunner",
    "Schedule",
    "ScheduleEntry",
    "ScheduleError",
    "SplitError",
    "StageModule",
    "StagePlan",
    "StepStats",
    "TensorSpec",
    "Timeline",
    "allreduce_tied_grads",
    "build_schedule",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_zb",
    "layer_counts",
    "no_pipelining",
    "num_microbatches",
    "one_f_one_b",
    "register_schedule",
    "schedule_entry",
    "simulate",
    "stage_plan",
    "stage_plans",
    "sync_tied_weights",
    "validate_pipeline",
    "with_transfers",
    "zb_h1",
]
