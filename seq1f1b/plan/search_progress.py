"""What a long schedule search says while it runs, for the tools to show.

seq1f1b-zb-auto's search takes seconds on most runs but minutes at scale (7B at 128K, TP 2
with SP, P = 16, m = 64, k = 8: about five minutes of one core's time, `plan.py search`), and
the trainer runs it on every rank before the first iteration: a search that says nothing looks
hung. The search reports its
stages (replays, depth search, refinement, annealing) to the logger `LOG` at INFO; the tools
show them (`shown`): plan.py on stderr, the trainer on the rank that logs. A line comes only
once `QUIET_SECONDS` have passed since the search began, and at most one every
`PERIOD_SECONDS` within a stage, so a search of a few seconds prints nothing. The clock decides
only what is printed, never the order found: every rank still finds the same one.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import IO, Iterator

LOG = logging.getLogger("seq1f1b.plan.search")
LOG.propagate = False        # shown where a tool asks (`shown`), not by whatever root logging

QUIET_SECONDS = 5.0
"""Nothing is said before a search has run this long."""

PERIOD_SECONDS = 10.0
"""Within a stage (`Progress.tick`), at most one line per this many seconds."""


class Progress:
    """One search's clock: `done` says a stage's result, `tick` how far a long stage is."""

    def __init__(self) -> None:
        self.began = self.said = time.monotonic()

    def done(self, message: str) -> None:
        self._say(message, period=0.0)

    def tick(self, message: str) -> None:
        self._say(message, period=PERIOD_SECONDS)

    def _say(self, message: str, period: float) -> None:
        now = time.monotonic()
        if now - self.began >= QUIET_SECONDS and now - self.said >= period:
            self.said = now
            LOG.info("%s [%.0f s]", message, now - self.began)


@contextlib.contextmanager
def shown(stream: IO[str], prefix: str) -> Iterator[None]:
    """Within the block, every search's lines are written to `stream`, each after `prefix`."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    level = LOG.level
    LOG.addHandler(handler)
    LOG.setLevel(logging.INFO)
    try:
        yield
    finally:
        LOG.removeHandler(handler)
        LOG.setLevel(level)
