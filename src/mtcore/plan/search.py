"""``search``: the layouts of a job that the trainer accepts and that fit memory, best first.

Candidates vary tp (up to one node), cp, pp, vpp, ep, the micro-batch size, sequence
parallel, ZeRO-1 and the model's recompute setting, keeping the world size and the
global batch. Each is checked with ``TrainConfig.check`` (the trainer's validators);
the ones reported are validated once more as a whole config, so no layout the trainer
would reject is ever listed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from mtcore.plan.hardware import Hardware
from mtcore.plan.planner import Options, Plan, _plan, with_data_vocab
from mtcore.plan.shapes import model_shape


@dataclass
class Ranked:
    plan: Plan
    config: object
    why: str = ""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(config, gpus: int, hardware: Hardware, max_micro_batch: int = 16):
    """Yield candidate configs (not yet checked)."""
    model, tr = config.model, config.training
    layers = model.num_layers
    recomputes = (
        ("none", "selective", "full") if "recompute" in type(model).model_fields else (None,)
    )
    experts = getattr(getattr(model, "moe", None), "num_experts", 0)
    zero1s = (False,) if config.optimizer.name == "onebit_adam" else (False, True)
    for tp in _divisors(gpus):
        if tp > hardware.gpus_per_node:
            break
        rest = gpus // tp
        for cp in (c for c in (1, 2, 4, 8, 16) if rest % c == 0):
            for pp in (p for p in _divisors(rest // cp) if p <= layers):
                dp = rest // (cp * pp)
                if tr.global_batch_size % dp:
                    continue
                per_rank = tr.global_batch_size // dp
                mbs = [b for b in _divisors(per_rank) if b <= max_micro_batch]
                vpps = [1] if pp == 1 else [v for v in (1, 2, 3, 4, 6, 8) if layers % (pp * v) == 0]
                eps = [e for e in _divisors(dp * cp) if experts and experts % e == 0] or [1]
                sps = (False, True) if tp > 1 else (False,)
                for vpp, ep, mb, sp, zero1, rc in itertools.product(
                    vpps, eps, mbs, sps, zero1s, recomputes
                ):
                    yield dict(
                        tp=tp,
                        cp=cp,
                        pp=pp,
                        dp=dp,
                        vpp=vpp,
                        ep=ep,
                        mb=mb,
                        sp=sp,
                        zero1=zero1,
                        recompute=rc,
                    )


def _with_layout(config, c: dict):
    from mtcore.training.config import ParallelConfig

    parallel = config.parallel.model_dump()
    parallel.update(
        tp=c["tp"],
        cp=c["cp"],
        pp=c["pp"],
        dp=c["dp"],
        vpp=c["vpp"],
        ep=c["ep"],
        sequence_parallel=c["sp"],
        zero1=c["zero1"],
        schedule="1f1b" if parallel["schedule"] != "gpipe" or c["vpp"] > 1 else "gpipe",
    )
    update = {
        "parallel": ParallelConfig(**parallel),
        "training": config.training.model_copy(update={"micro_batch_size": c["mb"]}),
    }
    if c["recompute"] is not None:
        update["model"] = config.model.model_copy(update={"recompute": c["recompute"]})
    return config.model_copy(update=update)


def search(config, gpus: int, hardware: Hardware, options: Options | None = None, top: int = 5):
    """The ``top`` fastest layouts that pass the trainer's checks and fit memory, and how
    many fit in all."""
    options = options or Options()
    config = with_data_vocab(config)
    shapes = {}
    found: list[tuple[float, Plan, object]] = []
    for c in candidates(config, gpus, hardware):
        try:
            candidate = _with_layout(config, c)
            spec, m = candidate.check(gpus)
        except ValueError:
            continue
        key = c["recompute"]
        if key not in shapes:
            shapes[key] = model_shape(candidate.model)
        result = _plan(candidate, spec, m, shapes[key], gpus, hardware, options)
        if result.fits:
            found.append((result.tokens_per_s, result, candidate))
    found.sort(key=lambda item: (-item[0], item[1].peak_memory))
    ranked: list[Ranked] = []
    for _, result, candidate in found:
        if len(ranked) == top:
            break
        try:  # the whole config once more, as `mtcore train` would read it
            type(candidate).model_validate(candidate.model_dump()).check(gpus)
        except ValueError:
            continue
        ranked.append(Ranked(result, candidate))
    _explain(ranked)
    return ranked, len(found)


def overheads(result: Plan) -> dict[str, float]:
    """Shares of the step: bubble, exposed communication, recompute, memory-bound work."""
    t = result.time
    comm = t.tp_comm + t.cp_comm + t.ep_comm + t.pp_comm + t.dp_exposed
    return {
        "bubble": t.bubble / t.total,
        "exposed comm": comm / t.total,
        "recompute": t.recompute / t.total,
    }


def _explain(ranked: list[Ranked]) -> None:
    """Each line says what it wins on: the overheads where it is lowest of those listed,
    and its own largest one."""
    if not ranked:
        return
    shares = [overheads(r.plan) for r in ranked]
    for i, r in enumerate(ranked):
        mine = shares[i]
        best_at = [
            k
            for k in mine
            if all(mine[k] <= s[k] + 1e-12 for s in shares)
            and any(mine[k] < s[k] - 1e-12 for s in shares)
        ]
        parts = [f"{k} {v:.1%}" for k, v in mine.items()]
        lead = f"lowest {', '.join(best_at)} of these; " if best_at else ""
        r.why = lead + ", ".join(parts)
