"""Which step is best: one rule for checkpoint selection (a2tgpo/eval/select.py), training's own
best-step bookkeeping (a2tgpo/train/rl.py) and the sweeps' objective (a2tgpo/sweep.py).

The best value wins by a strict comparison, so ties go to the EARLIEST step (the first
checkpoint that reached it); step 0 (the starting policy, saved before the first update) is a
candidate only for a method that does not train (ReAct, `method.train: false`). Training sits
below evaluation in the layer order, so the rule lives here, where both reach it.
"""

from __future__ import annotations

from collections.abc import Mapping


def is_candidate(step: int, *, trains: bool) -> bool:
    """Step 0, the starting policy, is a candidate only for a method that does not train."""
    return step > 0 or not trains


def best_step(values: Mapping[int, float], *, trains: bool, maximize: bool = True
              ) -> int | None:
    """The best step of `values` (step -> metric): the best value by a strict comparison, so
    among equal values the EARLIEST step wins; step 0 (the starting policy) is a candidate only
    when `trains` is False (the method does not train, e.g. ReAct). None when no step is a
    candidate. One rule for checkpoint selection, training's best step and sweep objectives."""
    best = None
    for step in sorted(values):
        if not is_candidate(step, trains=trains):
            continue
        v = values[step]
        if best is None or (v > values[best] if maximize else v < values[best]):
            best = step
    return best
