"""The plan layer: schedules as data, and everything that reads them without running a model.

Importing this package registers every schedule family, so `registry.names()` is complete.
"""
from seq1f1b.plan.actions import Action, Schedule, ScheduleError, dependencies, parse_action
from seq1f1b.plan import registry
from seq1f1b.plan.registry import build, names

__all__ = ["Action", "Schedule", "ScheduleError", "dependencies", "parse_action", "registry",
           "build", "names"]
