"""Pipeline schedules by name: which torch class each name stands for, how its stages sit on the ranks, and
what it asks of the number of stages and micro-batches (checked before anything is built).

``single`` schedules run one stage per rank. ``loop`` schedules run several (virtual) stages per rank, stage
``s`` on rank ``s % p``; ``v`` schedules run exactly two per rank, rank ``r`` holding stages ``r`` and
``2p - 1 - r`` so that the first and the last stage share rank 0.
"""

from __future__ import annotations

import difflib
from typing import Any

import attrs

from stratagem.errors import ConfigurationError


@attrs.frozen
class ScheduleInfo:
    name: str
    torch_class: str  # in torch.distributed.pipelining.schedules
    placement: str  # "single" | "loop" | "v"
    description: str
    #: Backward split into input gradients, then weight gradients later (zero bubble).
    splits_backward: bool = False


#: Every schedule torch 2.13 offers, under the names stratagem accepts.
SCHEDULES: dict[str, ScheduleInfo] = {
    info.name: info
    for info in (
        ScheduleInfo("gpipe", "ScheduleGPipe", "single", "all forwards, then all backwards"),
        ScheduleInfo("1f1b", "Schedule1F1B", "single", "one forward, one backward in the steady state"),
        ScheduleInfo(
            "interleaved_1f1b", "ScheduleInterleaved1F1B", "loop", "1F1B over several stages per rank"
        ),
        ScheduleInfo("looped_bfs", "ScheduleLoopedBFS", "loop", "breadth-first over several stages per rank"),
        ScheduleInfo(
            "zero_bubble",
            "ScheduleInterleavedZeroBubble",
            "loop",
            "interleaved, weight gradients deferred into the bubble (ZB1P)",
            splits_backward=True,
        ),
        ScheduleInfo(
            "zbv_zero_bubble",
            "ScheduleZBVZeroBubble",
            "v",
            "zero bubble on a V of two stages per rank",
            splits_backward=True,
        ),
        ScheduleInfo(
            "dual_pipe_v",
            "ScheduleDualPipeV",
            "v",
            "DualPipeV: a V of two stages per rank",
            splits_backward=True,
        ),
    )
}

#: Other spellings: torch's class names without "Schedule", compared without case or underscores.
_ALIASES = {"interleavedzerobubble": "zero_bubble", "zbv": "zbv_zero_bubble", "dualpipe": "dual_pipe_v"}


def _key(name: str) -> str:
    return name.replace("_", "").replace("-", "").lower()


def canonical(name: Any) -> Any:
    """The accepted name for ``name`` (``"Interleaved1F1B"`` -> ``"interleaved_1f1b"``); other input unchanged
    (the validator then says what is wrong)."""
    if not isinstance(name, str):
        return name
    key = _key(name.removeprefix("Schedule"))
    for known in SCHEDULES:
        if _key(known) == key:
            return known
    return _ALIASES.get(key, name)


def unknown_message(name: Any) -> str:
    close = difflib.get_close_matches(str(name).lower(), list(SCHEDULES), n=1, cutoff=0.4)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    listing = "; ".join(f"{n} ({i.description})" for n, i in SCHEDULES.items())
    return f"unknown schedule {name!r}.{hint} The schedules are: {listing}."


def default_stages_per_rank(schedule: str) -> int:
    # Several stages per rank is the point of the interleaved schedules; two is what the V ones require.
    return 1 if SCHEDULES[schedule].placement == "single" else 2


def check_placement(schedule: str, stages_per_rank: int) -> None:
    info = SCHEDULES[schedule]
    if info.placement == "single" and stages_per_rank != 1:
        multi = ", ".join(n for n, i in SCHEDULES.items() if i.placement != "single")
        raise ConfigurationError(
            f"schedule={schedule!r} runs one stage per rank, but stages_per_rank={stages_per_rank}. Use "
            f"stages_per_rank=1, or a schedule for several stages per rank: {multi}."
        )
    if info.placement == "v" and stages_per_rank != 2:
        raise ConfigurationError(
            f"schedule={schedule!r} places exactly two stages per rank in a V; stages_per_rank="
            f"{stages_per_rank}. Use stages_per_rank=2."
        )


def check(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> None:
    """Refuse a combination torch would refuse later (or, for some, deadlock on)."""
    check_placement(schedule, stages_per_rank)
    info = SCHEDULES[schedule]
    stages = pp * stages_per_rank
    if schedule == "dual_pipe_v" and microbatches < stages:
        raise ConfigurationError(
            f"schedule='dual_pipe_v' needs at least as many micro-batches as stages ({stages}); "
            f"microbatches={microbatches}."
        )
    if info.placement == "loop" and schedule != "looped_bfs":
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            good = [m for m in range(1, 4 * pp + 1) if m % max(1, m // pp) == 0]
            raise ConfigurationError(
                f"schedule={schedule!r} runs micro-batches in rounds of the pipeline size {pp}: microbatches="
                f"{microbatches} is not a multiple of its {rounds} rounds. Use e.g. one of {good}."
            )


def stage_ranks(schedule: str, pp: int, stages_per_rank: int) -> dict[int, int]:
    """Stage index -> pipeline rank (rank within the ``pp`` dimension)."""
    stages = pp * stages_per_rank
    if SCHEDULES[schedule].placement != "v":
        return {s: s % pp for s in range(stages)}
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    return generate_stage_to_rank_mapping(pp, stages, style="v")


def local_stages(schedule: str, pp: int, stages_per_rank: int, pp_rank: int) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` runs, in increasing order."""
    return sorted(s for s, r in stage_ranks(schedule, pp, stages_per_rank).items() if r == pp_rank)


def build(schedule: str, stages: list[Any], microbatches: int, loss_fn: Any) -> Any:
    """The torch schedule over this rank's ``PipelineStage`` objects. ``loss_fn`` returns the mean loss of one
    micro-batch, already divided by the number of micro-batches, so that gradients are those of the mean over
    the batch. Not torch's ``scale_grads``: it divides every gradient the parameters hold, those accumulated
    over earlier batches (``accumulate_grad_batches``) included."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, SCHEDULES[schedule].torch_class)
    if SCHEDULES[schedule].placement == "single":
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
