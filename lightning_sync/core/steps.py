"""Local vs synchronous step counting and LSSR (SelSync §IV-E, Eq. 4)."""

from __future__ import annotations

from typing import Any


class StepCounter:
    r"""Counts optimizer steps that were applied locally and steps that were synchronised.

    .. math:: \mathrm{LSSR} = \frac{steps_{local}}{steps_{local} + steps_{sync}}  \quad (4)

    LSSR is 0 for BSP and 1 for purely local training; :math:`1/(1-\mathrm{LSSR})` is the communication
    reduction over BSP for the same number of steps. Before any step LSSR is reported as 0.
    """

    def __init__(self) -> None:
        self.local_steps = 0
        self.sync_steps = 0

    def record(self, synced: bool) -> None:
        if synced:
            self.sync_steps += 1
        else:
            self.local_steps += 1

    @property
    def steps(self) -> int:
        return self.local_steps + self.sync_steps

    @property
    def lssr(self) -> float:
        total = self.steps
        return self.local_steps / total if total else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"local_steps": self.local_steps, "sync_steps": self.sync_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.local_steps = int(state["local_steps"])
        self.sync_steps = int(state["sync_steps"])
