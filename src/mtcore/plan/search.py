"""``search``: the layouts of a job that the trainer accepts and that fit memory, best first.

Candidates vary tp (dividing a node), cp, pp (with one fewer layer on the first and last
stage where the layers do not divide), vpp, ep (ep x tp dividing a node), the
micro-batch size, sequence parallel, ZeRO-1 and the model's recompute setting, keeping
the world size and the global batch. Each is checked with ``TrainConfig.check`` (the trainer's validators);
the ones reported are validated once more as a whole config, so no layout the trainer
would reject is ever listed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from mtcore.parallel.pipeline.table import form_for
from mtcore.plan.hardware import Hardware
from mtcore.plan.network import fits
from mtcore.plan.planner import Options, Plan, _plan, with_data_vocab
from mtcore.plan.shapes import model_shape


@dataclass
class Ranked:
    plan: Plan
    config: object
    why: str = ""


def _divisors(n: int, limit: int) -> list[int]:
    """Divisors of ``n`` up to ``limit``: the work is bounded by ``limit``, not ``n``."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _balanced_ends(layers: int, pp: int) -> int | None:
    """Layers for the first and last stage when ``pp`` does not divide ``layers``: the
    middle stages take ``ceil(layers / pp)`` each and the two ends share what is left
    equally (Llama 3's 126 layers on 16 stages: 7 + 14 x 8 + 7); None when that does
    not work out."""
    if pp < 3 or layers % pp == 0:
        return None
    share = -(-layers // pp)
    ends, odd = divmod(layers - share * (pp - 2), 2)
    return ends if not odd and 0 < ends < share else None


def candidates(config, gpus: int, hardware: Hardware, max_micro_batch: int = 16, options=None):
    """Yield candidate configs (not yet checked). tp and ep x tp divide a node unless
    ``options.cross_node``; every size is searched up to a bound that does not grow with
    ``gpus`` (tp up to a node, cp up to 16, pp up to the layers, the micro-batch up to
    ``max_micro_batch``), so an absurd accelerator count costs no more than a large one."""
    options = options or Options()
    model, tr = config.model, config.training
    layers = model.num_layers
    recomputes = (
        ("none", "selective", "full") if "recompute" in type(model).model_fields else (None,)
    )
    experts = model.experts.num_experts if model.experts is not None else 0
    zero1s = (False,) if config.optimizer.name == "onebit_adam" or options.zero else (False, True)
    node = hardware.gpus_per_node
    for tp in _divisors(gpus, node if not options.cross_node else 64):
        if not options.cross_node and not fits(tp, 1, node):
            continue
        rest = gpus // tp
        for cp in (c for c in (1, 2, 4, 8, 16) if rest % c == 0):
            for pp in _divisors(rest // cp, layers):
                dp = rest // (cp * pp)
                if tr.global_batch_size % dp:
                    continue
                per_rank = tr.global_batch_size // dp
                mbs = _divisors(per_rank, max_micro_batch)
                vpps = [1] if pp == 1 else [v for v in (1, 2, 3, 4, 6, 8) if layers % (pp * v) == 0]
                ends = _balanced_ends(layers, pp)
                splits = [(None, None)] + ([(ends, ends)] if ends is not None else [])
                vpps = vpps or ([1] if ends is not None else [])
                eps = [e for e in _divisors(dp * cp, experts) if experts and experts % e == 0]
                if not options.cross_node:
                    eps = [e for e in eps if fits(e * tp, 1, node)]
                sps = (False, True) if tp > 1 else (False,)
                for vpp, split, ep, mb, sp, zero1, rc in itertools.product(
                    vpps, splits, eps or [1], mbs, sps, zero1s, recomputes
                ):
                    yield dict(
                        tp=tp,
                        cp=cp,
                        pp=pp,
                        dp=dp,
                        vpp=vpp,
                        first=split[0],
                        last=split[1],
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
        first_stage_layers=c["first"],
        last_stage_layers=c["last"],
        schedule=form_for(parallel["schedule"], c["vpp"]),
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
    for c in candidates(config, gpus, hardware, options=options):
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
    comm = t.exposed_comm
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
