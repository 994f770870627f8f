"""One tracked steady-state training step on the CPU: what the byte tests compare estimates to."""

from __future__ import annotations

from helpers.memory import CategoryTracker
from helpers.train import RunConfig, Trainee


def measured(cfg: RunConfig):
    """One steady-state step of ``cfg`` on this CPU, tracked (as ``helpers.train.measure``)."""
    trainee = Trainee(cfg)
    trainee.step()
    tracker = CategoryTracker(device=trainee.device)
    tracker.track_external(trainee.model, trainee.optimizer)
    with tracker:
        trainee.step()
    return tracker.peaks()
