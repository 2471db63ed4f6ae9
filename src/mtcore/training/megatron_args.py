"""A Megatron-LM launch line (``pretrain_gpt.py --num-layers 32 ...``, inline or in
the shell script that builds it) as an mtcore training config.

``read_launch_args`` finds the arguments: a script's ``NAME=value``, ``NAME="..."``
and ``NAME=( ... )`` assignments are expanded where ``$NAME``, ``${NAME}``,
``${NAME:-default}`` or ``${NAME[@]}`` use them, and the command that runs a
``*.py`` program gives the arguments (or, with none, every ``--flag`` of the script).
``train_config_sections`` maps them to the config's sections; the model through the
GPT family's Megatron adapter (the mapping a checkpoint's saved arguments take too).
Each argument that maps to nothing is returned with the reason, for the caller to name.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from mtcore.models import get_family

_ASSIGN = re.compile(r"^\s*(?:export\s+|local\s+|declare\s+(?:-\w+\s+)?)?([A-Za-z_]\w*)=(.*)$")
_VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*)(?:\[@\]|\[\*\])?(?::?-([^}]*))?\}|\$([A-Za-z_]\w*)")
# store_false switches of Megatron-LM: flag -> (attribute, value)
_SWITCHES = {
    "disable_bias_linear": ("add_bias_linear", False),
    "no_position_embedding": ("add_position_embedding", False),  # beside rope: no effect
    "use_rotary_position_embeddings": ("position_embedding_type", "rope"),
    "use_distributed_optimizer": ("use_distributed_optimizer", True),
}
# What mtcore decides itself (kernels, fusions, launch, I/O): read, and said so.
_NOT_NEEDED = re.compile(
    r"^(use_flash_attn|use_mcore_models|transformer_impl|attention_backend|no_masked_softmax_"
    r"fusion|no_bias_.*fusion|no_gradient_accumulation_fusion|no_rope_fusion|.*_fusion|"
    r"distributed_backend|distributed_timeout_minutes|overlap_.*|num_workers|"
    r"no_async_tensor_model_parallel_allreduce|make_vocab_size_divisible_by|log_.*|"
    r"timing_log_level|ckpt_format|use_checkpoint_args|no_load_optim|no_load_rng|"
    r"exit_.*|split|recompute_granularity|recompute_method|recompute_num_layers|"
    r"accumulate_allreduce_grads_in_fp32|no_save_optim|no_save_rng|init_method_std)$"
)


def _expand(text: str, variables: dict[str, str]) -> str:
    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(3)
        return variables.get(name, match.group(2) or "")

    return _VARIABLE.sub(value, text)


def _strip_comment(line: str) -> str:
    return re.sub(r"(^|\s)#.*$", "", line)


def read_launch_args(source: str) -> list[str]:
    """The argument tokens of a launch script's Python program (``source``: a script
    path, or the arguments themselves)."""
    path = Path(source)
    try:
        is_script = "\n" not in source and path.is_file()
    except OSError:  # arguments too long to be a file name
        is_script = False
    text = path.read_text() if is_script else source
    text = text.replace("\\\n", " ")
    variables: dict[str, str] = {}
    statements: list[str] = []
    lines = iter(text.splitlines())
    for line in lines:
        line = _strip_comment(line)
        match = _ASSIGN.match(line)
        if match is None:
            statements.append(_expand(line, variables))
            continue
        name, value = match.groups()
        opening = value.lstrip()[:1]
        if opening in ("(", '"', "'"):
            closing = ")" if opening == "(" else opening
            while value.count(closing) < (1 if opening == "(" else 2):
                extra = next(lines, None)
                if extra is None:
                    break
                value += " " + _strip_comment(extra)
        value = value.strip()
        inner = value[1:-1] if value[:1] in ("(", '"', "'") else value
        variables[name] = _expand(inner, variables).strip()
    for statement in statements:
        tokens = shlex.split(statement, comments=True)
        programs = [i for i, token in enumerate(tokens) if token.endswith(".py")]
        if programs:
            return tokens[programs[0] + 1 :]
    if is_script:  # no program line: the script's flags, wherever they stand
        return [
            t for s in statements + list(variables.values()) for t in shlex.split(s, comments=True)
        ]
    return shlex.split(text, comments=True)


def parse_flags(tokens: list[str]) -> dict[str, Any]:
    """``--name value`` / ``--switch`` tokens as ``{attribute: value}`` (numbers as
    numbers, several values as a list); tokens before the first flag are dropped."""
    args: dict[str, Any] = {}
    name = None
    for token in tokens:
        if token.startswith("--"):
            name = token[2:].replace("-", "_")
            attribute, value = _SWITCHES.get(name, (name, True))
            args[attribute] = value
            if attribute != name:
                name = None
        elif name is not None:
            value = _number(token)
            previous = args[name]
            args[name] = (
                value
                if previous is True
                else [*previous, value]
                if isinstance(previous, list)
                else [previous, value]
            )
    return args


def _number(token: str) -> Any:
    for kind in (int, float):
        try:
            return kind(token)
        except ValueError:
            pass
    return token


# Megatron-LM attribute -> (section, key) of the mtcore config, taken as they are.
_DIRECT = {
    "tensor_model_parallel_size": ("parallel", "tp"),
    "pipeline_model_parallel_size": ("parallel", "pp"),
    "context_parallel_size": ("parallel", "cp"),
    "expert_model_parallel_size": ("parallel", "ep"),
    "sequence_parallel": ("parallel", "sequence_parallel"),
    "use_distributed_optimizer": ("parallel", "zero1"),
    "train_iters": ("training", "steps"),
    "global_batch_size": ("training", "global_batch_size"),
    "micro_batch_size": ("training", "micro_batch_size"),
    "seed": ("training", "seed"),
    "eval_interval": ("training", "eval_interval"),
    "eval_iters": ("training", "eval_batches"),
    "lr": ("optimizer", "lr"),
    "min_lr": ("optimizer", "min_lr"),
    "lr_warmup_iters": ("optimizer", "warmup_steps"),
    "lr_decay_iters": ("optimizer", "decay_steps"),
    "weight_decay": ("optimizer", "weight_decay"),
    "adam_eps": ("optimizer", "eps"),
    "save": ("checkpoint", "dir"),
    "save_interval": ("checkpoint", "interval"),
    "log_interval": ("logging", "interval"),
    "tensorboard_dir": ("logging", "tensorboard_dir"),
    "data_path": ("data", "paths"),
    "seq_length": ("data", "seq_len"),
    "vocab_size": ("data", "vocab_size"),  # a tokenizer trained to this size
}
# Read, but pointing elsewhere: what to do instead.
_ELSEWHERE = {
    "load": "a Megatron checkpoint: convert it (mtcore convert from-megatron DIR OUT), then "
    "set checkpoint.load to OUT",
    "mock_data": "with data.paths unset mtcore trains on its embedded corpus",
}
_SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant", "WSD": "wsd",
              "inverse-square-root": "inverse_sqrt"}  # fmt: skip


def train_config_sections(args: dict[str, Any]) -> tuple[dict[str, dict], list[str]]:
    """``(sections, notes)``: the mtcore config sections of Megatron-LM arguments, and
    one note per argument that maps to nothing (``--name value: why``)."""
    adapter = get_family("gpt").megatron
    config = adapter.config_from_args(args, None)
    sizes = ("style", "num_layers", "hidden_size", "num_heads")  # always shown
    model = {"family": "gpt", **{name: getattr(config, name) for name in sizes}}
    model.update(config.model_dump(mode="json", exclude_defaults=True, exclude={"family"}))
    model.pop("init_std", None)
    if "hidden_dropout" in args:
        model["dropout"] = args["hidden_dropout"]
    if "attention_dropout" in args:  # dropout of the attention probabilities, as Megatron's
        model["attention_dropout"] = args["attention_dropout"]
    sections: dict[str, dict] = {"model": model}
    used = set(_model_arguments(args))
    used.discard("seq_length")  # data.seq_len too (below)
    for name, (section, key) in _DIRECT.items():
        if name in args:
            value = args[name]
            sections.setdefault(section, {})[key] = (
                [value] if key == "paths" and not isinstance(value, list) else value
            )
            used.add(name)
    sections.setdefault("precision", {})["dtype"] = (
        "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else "fp32"
    )
    used |= {"bf16", "fp16"}
    optimizer = sections.setdefault("optimizer", {})
    if "adam_beta1" in args or "adam_beta2" in args:
        optimizer["betas"] = [args.get("adam_beta1", 0.9), args.get("adam_beta2", 0.999)]
        used |= {"adam_beta1", "adam_beta2"}
    if "clip_grad" in args:
        optimizer["max_grad_norm"] = args["clip_grad"] or None
        used.add("clip_grad")
    if args.get("lr_decay_style") in _SCHEDULES:
        optimizer["schedule"] = _SCHEDULES[args["lr_decay_style"]]
        used.add("lr_decay_style")
    layers_per_chunk = args.get("num_layers_per_virtual_pipeline_stage")
    if layers_per_chunk:
        pp = int(args.get("pipeline_model_parallel_size", 1))
        sections["parallel"]["vpp"] = config.num_layers // (pp * int(layers_per_chunk))
        sections["parallel"]["schedule"] = "interleaved_1f1b"
        used.add("num_layers_per_virtual_pipeline_stage")
    if str(args.get("tokenizer_model", "")).endswith(".json"):
        sections.setdefault("data", {})["tokenizer"] = args["tokenizer_model"]
        used.add("tokenizer_model")
    notes = []
    for name, value in args.items():
        if name in used:
            continue
        flag = f"--{name.replace('_', '-')}" + ("" if value is True else f" {value}")
        why = _ELSEWHERE.get(name) or (
            "mtcore decides it itself" if _NOT_NEEDED.match(name) else "no mtcore setting"
        )
        notes.append(f"{flag}: {why}")
    return sections, notes


def _model_arguments(args: dict[str, Any]) -> list[str]:
    """The arguments the model mapping reads, and the dropouts (``model.dropout``)."""
    names = [*get_family("gpt").megatron.model_arguments, "hidden_dropout", "attention_dropout"]
    return [name for name in names if name in args]
