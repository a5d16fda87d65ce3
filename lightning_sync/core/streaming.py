r"""Streaming DiLoCo's schedule (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication",
arXiv 2501.18512): the parameters split into :math:`K` fragments, each synchronised every :math:`H` inner
steps but at staggered steps, and each fragment's all-reduce overlapped with :math:`\tau` further inner steps before
its result is applied.

Step indices are 0-based optimizer steps; "after step k" means after the inner (local) update of step k. No
Lightning, no ``torch.distributed``: every rank computes the same schedule from its step count alone.
"""

from __future__ import annotations

from lightning_sync.core.validation import check_int

__all__ = ["FragmentSchedule", "fragment_ranges"]


def fragment_ranges(numel: int, fragments: int) -> list[tuple[int, int]]:
    """``fragments`` contiguous ``[start, end)`` ranges covering ``range(numel)`` in order, sizes differing by at
    most one element (boundaries ``f * numel // fragments``): the same on every rank. Fragments may cut through a
    parameter tensor; the flat buffer is what is synchronised."""
    numel = check_int("numel", numel, 0)
    fragments = check_int("fragments", fragments, 1)
    if fragments > max(numel, 1):
        raise ValueError(
            f"fragments must be an integer in [1, {max(numel, 1)}] (the number of elements), got {fragments}"
        )
    bounds = [f * numel // fragments for f in range(fragments + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class FragmentSchedule:
    r"""Which fragment's pseudo-gradient is taken (its all-reduce launched) and which fragment's result is applied
    after each step.

    With period :math:`H` (``sync_every``), :math:`K` fragments and spacing :math:`s = H/K`, fragment :math:`f`
    (0-based) is launched after step :math:`k` when :math:`(k + 1) \equiv (f + 1)\,s \pmod H` — fragment 0 first,
    after :math:`s` inner steps, fragment :math:`K-1` after :math:`H`, :math:`2H`, ... as plain DiLoCo syncs (the
    staggered offsets of torchft's ``_StreamingDiLoCoFragment``) — so each fragment is synchronised exactly once in
    every :math:`H` steps and one fragment every :math:`s` steps. Its result is applied after step
    :math:`k + \tau` (``delay``). :math:`H` must be a multiple of :math:`K` and :math:`\tau < s`, so at most one
    fragment is in flight at a time and never two launches or two applications at one step. :math:`K = 1`,
    :math:`\tau = 0` is DiLoCo's Algorithm 1: sync after every :math:`H` inner steps.

    Stateless: everything follows from the step index.
    """

    def __init__(self, sync_every: int, fragments: int = 1, delay: int = 0) -> None:
        self.sync_every = check_int("sync_every", sync_every, 1)
        self.fragments = check_int("fragments", fragments, 1, self.sync_every)
        if self.sync_every % self.fragments:
            raise ValueError(
                f"fragments must divide sync_every (each fragment is synced every sync_every steps, one fragment "
                f"every sync_every / fragments steps), got fragments={fragments} with sync_every={sync_every}"
            )
        self.spacing = self.sync_every // self.fragments
        self.delay = check_int("delay", delay, 0, self.spacing - 1)

    def launched_after(self, step: int) -> int | None:
        """The fragment whose pseudo-gradient is taken after step ``step`` (0-based), or None."""
        r = (check_int("step", step, 0) + 1) % self.sync_every
        if r % self.spacing:
            return None
        return self.fragments - 1 if r == 0 else r // self.spacing - 1

    def applied_after(self, step: int) -> int | None:
        """The fragment whose all-reduce result is applied after step ``step``: the one launched ``delay`` steps
        earlier (None before the first launch)."""
        launch = check_int("step", step, 0) - self.delay
        return self.launched_after(launch) if launch >= 0 else None

    def offset(self, fragment: int) -> int:
        """0-based step after which ``fragment`` is launched the first time: :math:`(f + 1) s - 1`."""
        fragment = check_int("fragment", fragment, 0, self.fragments - 1)
        return (fragment + 1) * self.spacing - 1

    def last_launch(self, fragment: int, step: int) -> int | None:
        """The last step ``<= step`` after which ``fragment`` was launched (None if it has not been yet)."""
        first = self.offset(fragment)
        step = check_int("step", step, -1)
        if step < first:
            return None
        return first + (step - first) // self.sync_every * self.sync_every
