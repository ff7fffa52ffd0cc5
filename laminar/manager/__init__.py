"""Manager policies as pure functions: the repack planner and the staleness/admission rules.

The manager node (laminar/manager/node.py), the buffer and bench/simulate.py import these, so
the simulator runs the very code the cluster runs. The function `staleness()` is not re-exported
here, so that `laminar.manager.staleness` stays the module: call `staleness.staleness(v, k)`.
"""

from laminar.manager.repack import (
    Move,
    RepackPlan,
    RolloutLoad,
    TrajLoad,
    is_candidate,
    plan_repack,
)
from laminar.manager.staleness import (
    MODES,
    ModePolicy,
    StalenessStats,
    admissible,
    may_start_group,
    needs_update,
    policy_for,
    start_cap,
)

__all__ = [
    "MODES",
    "ModePolicy",
    "Move",
    "RepackPlan",
    "RolloutLoad",
    "StalenessStats",
    "TrajLoad",
    "admissible",
    "is_candidate",
    "may_start_group",
    "needs_update",
    "plan_repack",
    "policy_for",
    "start_cap",
]
