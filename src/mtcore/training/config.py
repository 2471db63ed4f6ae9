"""The training job's configuration: a few small pydantic models, one per concern.

``TrainConfig`` has nine sections (``model``, ``parallel``, ``precision``,
``data``, ``optimizer``, ``training``, ``checkpoint``, ``logging``, ``finetune``); every
section rejects unknown keys and a boolean where a number belongs, and every section
but ``model`` an inf or NaN float. ``TrainConfig.check(world_size)`` rejects a layout
or batch arithmetic that cannot work before any process group starts. Reading
YAML/TOML files and ``--section.key value`` overrides is ``mtcore.training.overrides``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from mtcore.data import DataConfig
from mtcore.models import FamilyConfig, FamilyError, LoRAConfig, check_targets, parse_model_config
from mtcore.parallel.data import DEFAULT_BUCKET_SIZE
from mtcore.parallel.layout import LayoutSpec
from mtcore.parallel.pipeline import validate_pipeline
from mtcore.parallel.pipeline.table import check_virtual_stages, configurable_schedules
from mtcore.parallel.settings import reject_bool_numbers
from mtcore.training.schedules import Schedule, lr_at

# A config is read and checked without torch (`mtcore plan`); the precision objects it
# builds for the trainer (torch dtypes, FP8 scaling) are imported where they are made.
if TYPE_CHECKING:
    from mtcore.precision import MixedPrecision
    from mtcore.precision.fp8 import FP8Recipe


class ConfigError(ValueError):
    """A job that cannot run as configured, found before training starts; the message
    names the key, file or numbers."""


class Section(BaseModel):
    """A config section: unknown keys, booleans given for numbers (``--training.steps
    true`` would be 1) and inf/NaN floats (an ``lr`` of ``.inf``) are errors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    _no_bool_numbers = field_validator("*", mode="before")(reject_bool_numbers)


class DataSection(DataConfig):
    """``DataConfig`` as the ``data`` section reads it: booleans refused for numbers
    (``mtcore.data`` stays free of config policy)."""

    model_config = ConfigDict(allow_inf_nan=False)

    _no_bool_numbers = field_validator("*", mode="before")(reject_bool_numbers)


class ParallelConfig(LayoutSpec):
    """The layout (``LayoutSpec``: tp, dp, pp, vpp, sequence_parallel; ``dp=None`` takes
    what the world leaves) and how the trainer runs it."""

    schedule: str = Field(
        "1f1b",
        description="pipeline schedule, a name in the schedule table "
        "(mtcore.parallel.pipeline.table): 1f1b (with vpp > 1 the interleaved one), gpipe, "
        "interleaved_1f1b, zb_h1 (vpp 1) and interleaved_zb (vpp > 1): zero bubble (weight "
        "gradients fill the drain)",
    )
    zero: int = Field(
        0,
        ge=0,
        le=3,
        description="ZeRO stage: 1 shards the optimizer state over dp, 2 the gradients too, "
        "3 the transformer blocks' params too (gathered a block at a time)",
    )
    zero1: bool = Field(False, description="the older spelling of zero: 1")
    bucket_size: int = Field(DEFAULT_BUCKET_SIZE, ge=1, description="gradient bucket, elements")

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage: ``zero``, or 1 for the older ``zero1: true``."""
        return self.zero or int(self.zero1)

    @model_validator(mode="after")
    def _zero_stage(self) -> ParallelConfig:
        if self.zero1 and self.zero not in (0, 1):
            raise ValueError(
                f"parallel.zero1 is true but parallel.zero is {self.zero}; set only one"
            )
        return self

    @model_validator(mode="after")
    def _check_schedule(self) -> ParallelConfig:
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(f"vpp={self.vpp} (interleaving) needs pp > 1")
        if self.schedule not in configurable_schedules():
            known = ", ".join(configurable_schedules())
            raise ValueError(f"unknown schedule {self.schedule!r}; known: {known}")
        check_virtual_stages(self.schedule, self.vpp)
        return self

    def layout_spec(self) -> LayoutSpec:
        return LayoutSpec(**self.model_dump(include=set(LayoutSpec.model_fields)))


class PrecisionConfig(Section):
    """Params and compute in ``dtype``; fp32 gradients, master weights and AdamW state.

    ``fp8`` runs the transformer blocks' linears in FP8 (docs/fp8.md); the embedding
    and the output layer stay in ``dtype``.
    """

    dtype: Literal["fp32", "bf16", "fp16"] = "bf16"
    loss_scale: Literal["dynamic"] | float | None = Field(
        None, description="None: dynamic for fp16, none otherwise"
    )
    initial_scale: float = Field(2.0**16, gt=0)
    fp8: Literal["e4m3", "hybrid"] | None = Field(
        None, description="None: no FP8; e4m3 everywhere; hybrid: E4M3 forward, E5M2 gradients"
    )
    fp8_recipe: Literal["delayed", "current", "blockwise"] = Field(
        "delayed",
        description="per-tensor scale from an amax history, per-tensor just in "
        "time, or 1x128 activation/gradient and 128x128 weight blocks",
    )
    fp8_amax_history_len: int = Field(16, ge=1, description="delayed: amaxes the scale looks at")
    fp8_margin: int = Field(0, ge=0, description="delayed: scale = fp8_max / (amax * 2**margin)")
    fp8_first_last_high_precision: int = Field(
        0, ge=0, description="the first and the last N transformer blocks stay in dtype"
    )

    @model_validator(mode="after")
    def _check_fp8(self) -> PrecisionConfig:
        if self.fp8 is not None and self.dtype == "fp16":
            raise ValueError(
                "precision.fp8 needs precision.dtype bf16 or fp32, not fp16 (FP8 scaling "
                "replaces loss scaling)"
            )
        return self

    def fp8_config(self) -> FP8Recipe | None:
        if self.fp8 is None:
            return None
        from mtcore.precision.fp8 import FP8Recipe

        return FP8Recipe(
            format=self.fp8,
            scaling=self.fp8_recipe,
            amax_history_len=self.fp8_amax_history_len,
            margin=self.fp8_margin,
            first_last_high_precision=self.fp8_first_last_high_precision,
        )

    def check_backend(self, backend) -> None:
        """ConfigError when FP8 is asked for and ``backend`` cannot run it."""
        recipe = self.fp8_config()
        if recipe is not None:
            from mtcore.precision.fp8 import check_backend_fp8

            try:
                check_backend_fp8(recipe, backend.fp8)
            except ValueError as e:
                raise ConfigError(f"{e} (backend {backend.name!r})") from None

    def mixed_precision(self) -> MixedPrecision:
        from mtcore.precision import MixedPrecision

        return MixedPrecision(
            self.dtype, self.loss_scale, initial_scale=self.initial_scale, fp8=self.fp8_config()
        )


class OptimizerConfig(Section):
    """AdamW (or 1-bit Adam) with linear warmup to ``lr``, then ``schedule`` (cosine by
    default) down to ``min_lr``.

    ``name: onebit_adam`` runs ``freeze_step`` steps of AdamW, then freezes the
    variance and reduces a 1-bit compressed momentum over dp (docs/training.md).
    """

    name: Literal["adamw", "onebit_adam"] = Field(
        "adamw", description="onebit_adam: 1-bit compressed dp reduction after freeze_step"
    )
    freeze_step: int = Field(
        100, ge=1, description="onebit_adam: steps of plain AdamW before compression starts"
    )
    block_size: int = Field(
        128, ge=8, multiple_of=8, description="onebit_adam: elements that share one scale"
    )
    lr: float = Field(3e-4, gt=0)
    min_lr: float = Field(3e-5, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    warmup_steps: int = Field(100, ge=0)
    schedule: Schedule = Field("cosine", description="after warmup (training/schedules.py)")
    decay_steps: int | None = Field(
        None, ge=1, description="schedule length; None: the first run's training.steps"
    )
    wsd_decay_steps: int | None = Field(
        None, ge=1, description="wsd: cooldown steps at the end; None: a fifth of the schedule"
    )
    max_grad_norm: float | None = Field(1.0, gt=0, description="None: no clipping")

    @field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, betas: tuple[float, float]) -> tuple[float, float]:
        # beta = 1 never forgets (the moments stop following the gradients, and the
        # bias correction divides by zero); a negative one flips the average's sign.
        if not all(0 <= b < 1 for b in betas):
            raise PydanticCustomError("betas_range", "each beta must lie in [0, 1)")
        return betas

    def lr_at(self, step: int, total_steps: int) -> float:
        """Learning rate for optimizer step ``step`` (1-based); ``total_steps`` is the
        schedule's length when ``decay_steps`` is unset."""
        return lr_at(
            step,
            schedule=self.schedule,
            lr=self.lr,
            min_lr=self.min_lr,
            warmup_steps=self.warmup_steps,
            decay_steps=self.decay_steps or total_steps,
            wsd_decay_steps=self.wsd_decay_steps,
        )


class TrainingConfig(Section):
    """Steps, batch sizes (in sequences), seeds, evaluation and failure handling."""

    steps: int = Field(1000, ge=1)
    global_batch_size: int = Field(32, ge=1)
    micro_batch_size: int = Field(4, ge=1)
    # Below 2**63: the sample order's generator takes a signed 64-bit seed.
    seed: int = Field(1234, ge=0, le=2**63 - 1, description="weights, dropout and sample order")
    backend: str | None = Field(None, description="None: MTCORE_BACKEND, else the best one")
    eval_interval: int = Field(100, ge=0, description="0: evaluate only at the end")
    eval_batches: int = Field(4, ge=1, description="global batches per evaluation")
    max_bad_steps: int = Field(5, ge=1, description="stop after this many NaN/inf steps in a row")
    # Only a peer that hangs runs into it: one that exits is seen at once (the agent, a closed
    # connection, the shared-memory channel's pid check). 5 minutes (torch's default is 10,
    # torchtitan's 5 at start-up): a hung rank costs minutes, while what one rank does alone
    # as the others wait (rank 0 checksumming a commit at ~1 GB/s, a slow first step) fits.
    # At least 5 s: setting up the process group, and a rank a few seconds behind, need that.
    collective_timeout_s: float = Field(
        300.0,
        ge=5,
        description="a collective or transfer a peer does not answer in this long "
        "ends the job, naming the call and its ranks",
    )
    self_check: bool = Field(
        True,
        description="before step 1, check the backend's non-reference kernels against the "
        "reference ops (cached per machine) and its collectives; false: skip",
    )
    # Python's cyclic collector, left automatic, runs whenever allocation counts say: in the
    # middle of a step, on every rank at other moments (a collective then waits for the
    # slowest), 6-10% of a CPU job's time (docs/fp8.md). torchtitan's gc_freq does the same.
    gc_interval: int = Field(
        50,
        ge=0,
        description="steps between the loop's own garbage collections (generations 0 and 1, "
        "at a step's start, every rank alike); automatic collection is off while training. "
        "0: Python's automatic collection",
    )
    sample_prompt: str | None = Field("def ", description="printed continuation at the end")
    sample_tokens: int = Field(64, ge=0)


class CheckpointConfig(Section):
    """The whole training state every ``interval`` steps and at the end (docs/checkpoints.md).

    Sharded through torch.distributed.checkpoint, committed atomically under
    ``dir/step_<N>/``; it resumes exactly and loads under any other layout.
    """

    dir: str | None = Field("runs/gpt/checkpoints", description="None: save nothing")
    interval: int = Field(0, ge=0, description="steps between saves (0: at the end only)")
    keep_last: int = Field(0, ge=0, description="keep the newest K checkpoints (0: all)")
    async_save: bool = Field(False, description="write in the background while training goes on")
    load: str | None = Field(
        None, description="checkpoint to start from: a step directory or a root (its latest)"
    )
    resume: bool = Field(
        False, description="continue from dir's latest checkpoint when there is one (restarts)"
    )
    finetune: bool = Field(
        False, description="take only the model weights from the loaded checkpoint (step 0)"
    )
    overwrite: bool = Field(
        False,
        description="start afresh in a dir holding another run's checkpoints; the first "
        "commit removes them (otherwise that is refused)",
    )


class FinetuneConfig(Section):
    """Fine-tuning: ``lora`` freezes the model and trains low-rank adapters on the named
    linears (docs/finetuning.md); None (the default) trains every weight. The model to
    start from is ``checkpoint.load`` (with ``checkpoint.finetune: true`` for full
    fine-tuning); a LoRA checkpoint holds the adapters and a reference to that base."""

    lora: LoRAConfig | None = Field(None, description="{rank, alpha, dropout, targets}")


class ProfileConfig(Section):
    """``logging.profile``: steps ``[from, to]`` (inclusive) traced with torch.profiler on
    ``ranks``, one Chrome trace per rank under ``dir`` (default runs/<run_name>/traces);
    ``memory``: a memory counter over time and the peak per phase; ``torch_profiler``
    false: the named phases alone (small traces, and a torch.profiler already running,
    such as ``mtcore sweep``'s memory recorder, is left alone) (docs/training.md,
    "Profiling")."""

    steps: tuple[int, int] = Field(description="the first and last step traced")
    ranks: Literal["all"] | list[int] = Field("all", description="all, or a list of ranks")
    memory: bool = Field(False, description="memory over time, in the same trace")
    dir: str | None = Field(None, description="where the traces go (default runs/<run_name>/traces)")
    torch_profiler: bool = Field(
        True, description="false: mtcore's named phases alone, without torch.profiler's ops"
    )

    @model_validator(mode="after")
    def _ordered(self) -> ProfileConfig:
        first, last = self.steps
        if first < 1 or last < first:
            raise ValueError(f"logging.profile.steps {list(self.steps)}: needs 1 <= from <= to")
        if self.ranks != "all" and any(r < 0 for r in self.ranks):
            raise ValueError(f"logging.profile.ranks {self.ranks}: ranks are >= 0")
        return self


class LoggingConfig(Section):
    run_name: str = Field(
        "gpt",
        pattern=r"^[A-Za-z0-9._-]*[A-Za-z0-9_-][A-Za-z0-9._-]*$",  # one path component
        description="the run's name: checkpoint.dir and tensorboard_dir default to "
        "runs/<run_name>/; mtcore train sets it to the config file's name",
    )
    interval: int = Field(10, ge=1, description="steps between log lines")
    tensorboard_dir: str | None = Field("runs/gpt/tensorboard", description="None: off")
    progress: Literal["auto", "bar", "lines"] = Field(
        "auto", description="auto: a progress bar on a terminal, plain lines otherwise"
    )
    wandb: bool = Field(False, description="also log to Weights & Biases (mtcore[wandb])")
    wandb_project: str = Field("mtcore", min_length=1, description="the W&B project")
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description="offline: write the run under runs/<run_name>/wandb only"
    )
    profile: ProfileConfig | None = Field(None, description="{steps, ranks, memory}: traces")
    straggler_factor: float | None = Field(
        1.2, gt=1.0, description="name a rank computing this much slower than its stage's "
        "median at each log line (None: off)",
    )


class TrainConfig(BaseModel, extra="forbid"):
    # A discriminated union over the registered families (built-in and plugins'):
    # ``model.family`` picks the config class; no ``family`` key means gpt.
    model: SerializeAsAny[FamilyConfig] = Field(default_factory=lambda: parse_model_config({}))
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    data: DataSection = Field(default_factory=DataSection)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)

    @field_validator("data", mode="before")
    @classmethod
    def _data_section(cls, value):
        if type(value) is DataConfig:  # built in code: check it as the section would
            return value.model_dump(exclude_unset=True)
        return value

    @field_validator("model", mode="before")
    @classmethod
    def _family_config(cls, value):
        try:
            return parse_model_config(value)
        except FamilyError as e:
            raise ValueError(str(e)) from None

    @model_validator(mode="after")
    def _run_directories(self) -> TrainConfig:
        # Directories not set are the run's own, so two runs of different names never
        # write into one another's (trainer.check_run_directory refuses the rest).
        name = self.logging.run_name
        if "dir" not in self.checkpoint.model_fields_set:
            self.checkpoint.dir = f"runs/{name}/checkpoints"
        if "tensorboard_dir" not in self.logging.model_fields_set:
            self.logging.tensorboard_dir = f"runs/{name}/tensorboard"
        if self.logging.profile is not None and self.logging.profile.dir is None:
            self.logging.profile.dir = f"runs/{name}/traces"
        return self

    @model_validator(mode="after")
    def _one_seq_len(self) -> TrainConfig:
        # model.seq_len is the one source of truth; data.seq_len may only repeat it.
        if "seq_len" in self.data.model_fields_set and self.data.seq_len != self.model.seq_len:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} differs from model.seq_len="
                f"{self.model.seq_len}; set model.seq_len only"
            )
        self.data = self.data.model_copy(update={"seq_len": self.model.seq_len})
        return self

    @model_validator(mode="after")
    def _lora_targets(self) -> TrainConfig:
        if self.finetune.lora is not None:
            check_targets(self.finetune.lora, self.model)
        return self

    @model_validator(mode="after")
    def _onebit_layouts(self) -> TrainConfig:
        if self.optimizer.name == "onebit_adam" and self.parallel.zero_stage >= 1:
            raise ValueError(
                "optimizer.name onebit_adam cannot run with parallel.zero1 (zero >= 1): every rank "
                "compresses its whole local momentum, so the momentum cannot be sharded"
            )
        if self.optimizer.name == "onebit_adam" and self.model.experts is not None:
            raise ValueError(
                "optimizer.name onebit_adam compresses the dense data-parallel reduction only; "
                "a mixture-of-experts model (model.moe) is not supported"
            )
        return self

    def check(self, world_size: int) -> tuple[LayoutSpec, int]:
        """The resolved layout and micro-batches per step, or a LayoutError/SplitError
        naming the numbers. Runs before any process group exists."""
        spec = self.parallel.layout_spec().resolve(world_size)
        profiled = self.logging.profile.ranks if self.logging.profile is not None else "all"
        if profiled != "all" and max(profiled, default=0) >= world_size:
            raise ValueError(f"logging.profile.ranks {profiled}: the job has {world_size} ranks")
        self.model.check_layout(spec)
        t = self.training
        microbatches = validate_pipeline(
            t.global_batch_size,
            t.micro_batch_size,
            spec.dp,
            spec.pp,
            self.model.num_layers,
            spec.vpp,
            first=spec.first_stage_layers,
            last=spec.last_stage_layers,
        )
        return spec, microbatches
