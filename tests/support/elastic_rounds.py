"""Workers for the membership tests: rounds of a sum over the run's current epoch, in processes of their own.

Each round every member adds 1.0 into a sum and adds the sum (the epoch's size) to its weight `w`, so the members
of an epoch hold equal weights after every round; a newcomer takes the weight and the round from the view's source,
so it holds them too. A round whose sum fails (a peer missed the deadline) is redone in the next epoch: every round
is summed once by the members of some epoch, and each worker's log says which.
"""

from __future__ import annotations

import datetime
import os
import queue
import random
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raytrm.sync.membership import ABANDONED, Dropped, Membership, PeerLost, RunFinished, View, is_peer_lost


def worker(name: str, port: int, plan: dict[str, Any], results: Any) -> None:
    """One worker of the run: start (or join, if plan['join']) then rounds until plan['rounds']; puts its log."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    members = Membership(store, name, deadline=plan["deadline"], settle_s=plan["settle"])
    log: dict[str, Any] = {"name": name, "pid": os.getpid(), "rounds": [], "epochs": [], "waits": [], "regroups": []}
    state = {"round": 0, "w": 0.0, "last": plan["rounds"]}
    if plan.get("join"):
        view = members.join()
        state = _take_state(members, dict(state, round=-1))
    else:
        view = members.start(plan["size"])
    log["epochs"].append([view.epoch, list(view.members)])
    results.put(("ready", name, os.getpid()))
    while state["round"] < state["last"]:
        delay = _delay(plan, state["round"], name)
        begin = time.monotonic()
        try:
            if delay:
                time.sleep(delay)
            total = torch.ones(1)
            dist.all_reduce(total)
            state["w"] += float(total)
            log["rounds"].append([state["round"], view.epoch, int(total)])
            state["round"] += 1
            log["waits"].append(time.monotonic() - begin - delay)
            view, state = _boundary(members, view, state, log)
        except Exception as error:  # a lost peer, here or at the boundary: the next epoch, then the round again
            if not (isinstance(error, PeerLost) or is_peer_lost(error)):
                raise
            log["waits"].append(time.monotonic() - begin - delay)
            regroup = time.monotonic()
            try:
                view, state = _next_epoch(members, state, log)
            except RunFinished:
                log["finished_outside"] = True
                break
            log["regroups"].append(time.monotonic() - regroup)
        time.sleep(plan.get("pace", 0.0))
    log["w"], log["final_epoch"] = state["w"], view.epoch
    members.leave(finished=not log.get("finished_outside"))
    results.put(("done", name, log))


def _delay(plan: dict[str, Any], round_: int, name: str) -> float:
    """The delay this worker injects before this round's sum: one in `delay_every` rounds, one worker's, drawn from
    the same seeded stream on every worker so they agree whose (the seed is the round)."""
    every = plan.get("delay_every")
    if not every:
        return 0.0
    draw = random.Random(plan.get("seed", 0) * 1_000_003 + round_)
    if draw.randrange(every) != 0 or draw.choice(plan["names"]) != name:
        return 0.0
    return draw.choice(plan["delays"])


def _boundary(members: Membership, view: Any, state: dict, log: dict) -> tuple[Any, dict]:
    """A round boundary: rank 0 asks the store for join requests and for the test's "stop" (the run then ends
    after this round), the members agree on both; a join request: the next epoch."""
    import torch.distributed as dist

    flags = torch.zeros(2)
    if dist.get_rank() == 0:
        flags[0] = float(members.pending_joins() > 0)
        flags[1] = float(members.store.check(["stop"]))
    dist.all_reduce(flags)
    if flags[1] > 0:
        state["last"] = state["round"]
    if flags[0] == 0:
        return view, state
    return _next_epoch(members, state, log)


def _next_epoch(members: Membership, state: dict, log: dict) -> tuple[Any, dict]:
    """Regroup (or, left behind, join again) until an epoch forms; newcomers take the state from its source."""
    while True:
        try:
            try:
                view = members.regroup()
            except Dropped:
                log["dropped"] = log.get("dropped", 0) + 1
                view = members.join()
            log["epochs"].append([view.epoch, list(view.members)])
            return view, _take_state(members, state)
        except PeerLost:
            continue
        except RuntimeError as error:
            if not is_peer_lost(error):
                raise


def _take_state(members: Membership, state: dict) -> dict:
    """The state of the member furthest along, on every member of the new epoch (collectives of it)."""
    import torch.distributed as dist

    source, apart = members.source(state["round"])
    if not apart:
        return state
    box = [state]
    dist.broadcast_object_list(box, src=source)
    return dict(box[0])


class Run:
    """Workers of elastic_rounds in processes of their own, around a store served by this process."""

    def __init__(self, plan: dict, target=None, extra: tuple = ()) -> None:
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
        )
        self.plan, self.target, self.extra = plan, target or worker, extra
        self.context = mp.get_context("spawn")
        self.results = self.context.Queue()
        self.procs: dict[str, mp.Process] = {}
        self.pids: dict[str, int] = {}
        self.logs: dict[str, dict] = {}

    def start(self, name: str, **extra) -> None:
        plan = {**self.plan, **extra}
        args = (name, self.store.port, plan, *self.extra, self.results)
        proc = self.context.Process(target=self.target, args=args, daemon=True)
        proc.start()
        self.procs[name] = proc

    def wait(self, kind: str, count: int, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        seen = 0
        while seen < count:
            try:
                what, name, value = self.results.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{count - seen} worker(s) never reported {kind!r}") from None
            if what == "ready":
                self.pids[name] = value
            else:
                self.logs[name] = value
            seen += what == kind

    def admitted(self, name: str, timeout: float = 120) -> None:
        """Wait until a published view admits the worker."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            epoch = self.store.add("epoch", 0)
            views = [self.store.get(f"view/{e}") for e in range(epoch + 1) if self.store.check([f"view/{e}"])]
            if any(v != ABANDONED and name in View.from_json(v).admitted for v in views):
                return
            time.sleep(0.1)
        raise AssertionError(f"{name} was never admitted")

    def stop(self) -> None:
        """The workers end the run at their next round boundary."""
        self.store.set("stop", "1")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
            proc.join(timeout=10)
