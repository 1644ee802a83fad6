"""Fault injection: seeded, replayable fault plans and the injectors that carry them out.

A training loop opts in to step-exact faults with one call, a no-op unless a chaos run set
``ELASTICTK_FAULT_PLAN``::

    import elastictk.faults
    for step in range(start, steps):
        elastictk.faults.fault_point(step)
"""
from .generate import generate, generate_plan
from .inworker import InjectedFault, fault_point
from .kinds import KINDS, FaultKindError, PlanError
from .knobs import Knobs
from .plan import Fault, FaultPlan, plan_of
from .target import Target

__all__ = ["fault_point", "InjectedFault", "Fault", "FaultPlan", "plan_of", "Target", "Knobs",
           "generate", "generate_plan", "KINDS", "PlanError", "FaultKindError"]
