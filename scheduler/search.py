"""Exhaustive search over offload groups, for benches that check the gate.

The gate picks a plan from a cost model; a bench measures whether that plan
is really (near) the fastest by trying every on/off combination of the five
projection groups, the same choice in every layer, and timing each. This
module enumerates those plans and the model's predictions for them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from .ops import PROJECTION_GROUPS
from .plan import Plan, build_plan


@dataclass(frozen=True)
class GroupPlanResult:
    choice: dict          # {group: on_gpu}, the same in every layer
    predicted_us: float   # cost-model time of the step
    syncs_per_step: int
    launches_per_step: int
    plan: Plan


def enumerate_group_plans(config, tokens: int, profile, *, resident_weights=None,
                          context_len: int = 0) -> list:
    """All 2**5 group choices as GroupPlanResult, fastest predicted first."""
    results = []
    for bits in itertools.product((False, True), repeat=len(PROJECTION_GROUPS)):
        choice = dict(zip(PROJECTION_GROUPS, bits))
        plan = build_plan(config, tokens, "gated", profile, group_choice=choice,
                          resident_weights=resident_weights, context_len=context_len)
        results.append(GroupPlanResult(choice, plan.predicted_step_us(profile, resident_weights),
                                       plan.syncs_per_step, plan.launches_per_step, plan))
    return sorted(results, key=lambda r: r.predicted_us)


def gate_vs_best(config, tokens: int, profile, *, context_len: int = 0) -> dict:
    """The calibrated gate's plan next to the best enumerated one (predicted times)."""
    gated = build_plan(config, tokens, "gated", profile, context_len=context_len)
    best = enumerate_group_plans(config, tokens, profile, context_len=context_len)[0]
    gated_us = gated.predicted_step_us(profile)
    return {"tokens": tokens, "gate_choice": gated.groups_on_gpu(), "gate_us": gated_us,
            "best_choice": best.choice, "best_us": best.predicted_us,
            "gate_over_best": gated_us / best.predicted_us}
