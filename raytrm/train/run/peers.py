"""The peers in the training loop: after each step, once this worker's cut is decided, the workers exchange their
times, memory caps and events (raytrm.sync.peers); inside a local round they wait for its end."""

from __future__ import annotations

from typing import Any

from raytrm.sync.peers import Peers
from raytrm.train.loop import Hook, Loop, Step
from raytrm.train.trainer import StepResult, Trainer


class PeersHook(Hook):
    """Exchanges after every step: the step's events become every worker's (what the metrics log writes) and its rows
    every worker's. Inside a round of the local sync mode it holds the steps and exchanges at the round's end, with
    the round's mean times and all its events. A checkpoint part ("shares_balancer")."""

    def __init__(self, trainer: Trainer, balance: bool = True) -> None:
        self.balance = balance
        self.peers = Peers(trainer, balance=balance)
        self._held: list[StepResult] = []  # the steps of a local round so far, and their events
        self._held_events: list[dict[str, Any]] = []

    def end_step(self, loop: Loop, step: Step) -> None:
        if not loop.exchanging:  # inside a local round: held until its end, when the workers exchange again
            self._held.append(step.result)
            self._held_events += step.events
            step.events, step.workers = [], self.peers.rows
            return
        held, events = self._held, [*self._held_events, *step.events]
        self._held, self._held_events = [], []
        step.events = self.peers.exchange(step.result, step.share_cap, events, held)
        step.workers = self.peers.rows

    def on_regroup(self, loop: Loop) -> None:
        """Another set of workers: their rows and the balancer start again from the shares the new membership set
        (each member's pace; a held local round was dropped with the change)."""
        self.peers = Peers(loop.trainer, balance=self.balance)
        self._held, self._held_events = [], []

    def state_dict(self) -> dict[str, Any] | None:
        return self.peers.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.peers.load_state_dict(state)

    def summary(self) -> dict[str, Any]:
        return self.peers.summary()
