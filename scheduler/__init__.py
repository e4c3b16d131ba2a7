"""Pure-Python scheduling for kestrel-stream: cost model, placement plan, residency window.

Imports no CUDA: it takes a DeviceProfile (plain numbers) and a model config
and returns plain data, so all of it is testable on a machine without a GPU.
"""
from .gate import MINFLOP_ENV, Gate, GateDecision, GpuCost
from .ops import PROJECTION_GROUPS, Op, WeightRef, model_weight_names, runs_alone, step_ops
from .plan import (LAYER_KINDS, Placement, Plan, PlanAuditError, Segment, audit_plan, build_plan, mode_name,
                   parse_mode)
from .transfers import count_transfers, segment_inputs
from .search import GroupPlanResult, enumerate_group_plans, gate_vs_best
from .window import WindowBudgetError, WindowItem, WindowPlan, plan_window, window_items
from .profile import (H200_MEASURED, SEED_LIKE, DeviceProfile, load_profile,
                      profile_cache_path, save_profile)

__all__ = [
    "MINFLOP_ENV", "Gate", "GateDecision", "GpuCost",
    "PROJECTION_GROUPS", "Op", "WeightRef", "model_weight_names", "runs_alone", "step_ops",
    "GroupPlanResult", "Placement", "Plan", "PlanAuditError", "Segment", "audit_plan",
    "build_plan", "count_transfers", "segment_inputs", "enumerate_group_plans", "gate_vs_best", "parse_mode",
    "mode_name", "LAYER_KINDS",
    "H200_MEASURED", "SEED_LIKE", "DeviceProfile", "load_profile", "profile_cache_path",
    "save_profile",
    "WindowBudgetError", "WindowItem", "WindowPlan", "plan_window", "window_items",
]
