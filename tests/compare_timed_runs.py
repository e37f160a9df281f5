"""A stand-in for ``diffattn compare``'s run of one job, for its tests: it sleeps for the
seconds its job's ``seed`` names and returns what a run returns. A module of its own, so that
spawned workers import it."""

from __future__ import annotations

import time


def sleeping_run(job):
    time.sleep(job.seed)
    return 0, {}, float(job.seed), "cpu"
