"""Who trains together, epoch by epoch: workers that stop answering are left behind within a deadline, and workers
that come back (or arrive) enter at a round boundary, without the group being restarted.

A run's workers agree on their membership through a key-value store that none of them hosts (a
`torch.distributed.TCPStore` served by the driver), so a worker that sleeps takes nothing the others need with it.
Each membership is an epoch: a `View` (its number, its members in rank order, who was admitted into it and who left
it) and a process group of its own, made under the epoch's prefix of the store with the deadline as its timeout, so
no collective of it waits longer than that.

An epoch ends in one of two ways, and both go through the same agreement (`regroup`):
- a collective fails (a peer missed the deadline, or its connections closed): every member that sees it arrives at
  the next epoch; the first arrival leads: it waits until every member of the old epoch has arrived, or `settle_s`,
  then publishes the next view with those that arrived, and the workers that asked to join meanwhile. For the old
  rank 0 (the worker that writes the run) it waits a deadline longer: blocked in a sum with a peer that died, it
  sees the failure only at its deadline, where a peer whose connection to the dead one closed sees it at once;
- at a round boundary the members see a join request (`pending_joins`, asked of the store by rank 0 and agreed in
  the current group by the caller) and regroup to admit it.

A worker outside the current view (new, or back from sleep to find the others went on) calls `join`: it files a
request and waits for a view that names it. A member that arrives after the view it arrived for was published is
not in it: `regroup` raises `Dropped`, and it joins like a newcomer. Once an epoch forms, its members agree whose
state they all take (`source`): the member furthest along, since a collective can complete on some ranks and fail on
others, leaving the members a step apart. What a newcomer needs (the weights, the optimizer, the step) comes from
that live member, never from a checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

#: The shortest deadline of a collective: below it, a busy machine's scheduling jitter would read as a lost peer.
MIN_DEADLINE_S = 2.0
#: A collective's deadline in multiples of what it should take (the sum over the link plus the slowest peer's step).
DEADLINE_GRACE = 3.0
#: How long a forming epoch waits for members that have not arrived, once one has: the others see the same failure
#: within about a deadline of each other, so it is longer than the shortest deadline (a member blocked in a sum with
#: a Mac killed mid-run sees the failure at its deadline, one whose connection to that Mac closed sees it at once).
SETTLE_S = 3.0
#: An epoch given up because its leader went quiet before publishing it.
ABANDONED = b"abandoned"
#: The key set when the run ends.
FINISHED = "finished"
#: The key of the deadline the members agreed, once the run measured its steps.
DEADLINE_KEY = "deadline"
#: How long members hold for rank 0's work alone (an evaluation) at most: rank 0 is the driver's first worker, whose
#: loss ends the run anyway, so this only keeps a wait from being endless.
HOLD_S = 3600.0


def deadline_s(sum_s: float, step_s: float) -> float:
    """A collective's deadline: the grace times what it should take, the sum over the measured link plus a step of
    the slowest peer (which may start its sum that much later), and never under MIN_DEADLINE_S."""
    return max(MIN_DEADLINE_S, DEADLINE_GRACE * (sum_s + step_s))


def group_timeout(group: Any = None, device: Any = None) -> datetime.timedelta | None:
    """How long a collective of the process group (None: the default group) may take, as its backend for `device`
    (the CPU's by default) holds it; None where torch does not say."""
    import torch
    from torch.distributed.distributed_c10d import _get_default_group

    pg = group if group is not None else _get_default_group()
    try:
        return pg._get_backend(device if device is not None else torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


def set_group_timeout(seconds: float, group: Any = None) -> None:
    """Bound every collective of the live process group (None: the default group) by `seconds` from now on."""
    from torch.distributed.distributed_c10d import _set_pg_timeout  # torch's setter of a live group's timeout

    _set_pg_timeout(datetime.timedelta(seconds=seconds), group)


class PeerLost(RuntimeError):
    """A collective of the current epoch failed: a peer missed the deadline or left."""


class Dropped(RuntimeError):
    """The members formed the next epoch without this worker (it arrived late): it must `join` again."""


class RunFinished(RuntimeError):
    """The run ended while this worker was outside it: there is nothing to join."""


@dataclasses.dataclass(frozen=True)
class View:
    """One epoch's membership: the members in rank order, who entered at it and who left at it."""

    epoch: int
    members: tuple[str, ...]
    admitted: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    #: How many join requests the view has answered (the index into the store's log of requests).
    joins_seen: int = 0
    #: Its leader held it past the settle for the old rank 0, which came: the next epoch does not hold for it again,
    #: so that a rank 0 late at every try (its sum past the deadline each time) is left behind, and the others go on.
    held_for_rank_0: bool = False

    def rank(self, worker: str) -> int:
        return self.members.index(worker)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> View:
        doc = json.loads(text)
        return cls(
            doc["epoch"],
            tuple(doc["members"]),
            tuple(doc["admitted"]),
            tuple(doc["left"]),
            doc["joins_seen"],
            doc["held_for_rank_0"],
        )


def is_peer_lost(error: BaseException) -> bool:
    """Whether a collective's error says a peer missed its deadline or went away (gloo's words for both)."""
    text = str(error)
    return isinstance(error, (RuntimeError, ConnectionError)) and any(
        words in text for words in ("Timed out", "timed out", "Connection closed", "Connection reset", "Broken pipe")
    )


class Membership:
    """One worker's side of the run's membership, through the run's store (see the module's docstring).

    `store` is a `torch.distributed.Store` client (a TCPStore's), `me` this worker's name, unique in the run and the
    same when it comes back. `deadline` bounds every collective of an epoch's group; `settle_s` bounds how long a
    forming epoch waits for members that do not arrive.
    """

    def __init__(
        self,
        store: Any,
        me: str,
        *,
        deadline: float = MIN_DEADLINE_S,
        settle_s: float = SETTLE_S,
        backend: str = "gloo",
    ) -> None:
        self.store, self.me, self.backend = store, me, backend
        self.deadline, self.settle_s = deadline, settle_s
        self.view: View | None = None

    # -- the store's keys --------------------------------------------------------------------------------------------

    def _get(self, key: str, wait_s: float) -> bytes | None:
        """The key's value, waiting up to wait_s for it to be set; None if it was not."""
        if wait_s <= 0:
            return self.store.get(key) if self.store.check([key]) else None
        try:
            self.store.wait([key], datetime.timedelta(seconds=wait_s))
        except RuntimeError:  # the store's wait raises at its timeout
            return None
        return self.store.get(key)

    def _count(self, key: str) -> int:
        return int(self.store.add(key, 0))

    # -- forming epochs ----------------------------------------------------------------------------------------------

    def start(self, size: int, timeout_s: float = 300.0) -> View:
        """The run's first epoch, of the first `size` workers to call this (every worker of a fresh run calls it)."""
        return self._form(0, expected=size, previous=None, timeout_s=timeout_s)

    def regroup(self) -> View:
        """After a failed collective (`PeerLost`), or to admit join requests: the next epoch's view, of the members
        that arrive within `settle_s` of the first and the workers that asked to join. Raises `Dropped` where the
        next epoch was formed without this worker."""
        assert self.view is not None, "regroup before start or join"
        return self._form(self.view.epoch + 1, expected=len(self.view.members), previous=self.view)

    def join(self, timeout_s: float = 600.0) -> View:
        """Ask to enter the run (new, or back after being left behind) and wait for the view that admits this
        worker: the members admit it at their next round boundary."""
        slot = int(self.store.add("joins", 1)) - 1  # a slot in the log of requests, then this worker's name in it
        self.store.set(f"join/{slot}", self.me)
        deadline = time.monotonic() + timeout_s
        epoch = self._count("epoch")
        while time.monotonic() < deadline:
            if self.store.check([FINISHED]):
                raise RunFinished(f"{self.me}: the run ended while this worker was away")
            text = self._get(f"view/{epoch}", min(1.0, max(0.0, deadline - time.monotonic())))
            if text is None:
                epoch = max(epoch, self._count("epoch"))
                continue
            if text != ABANDONED and self.me in (view := View.from_json(text)).members:
                return self._enter(view)
            epoch += 1
        raise TimeoutError(f"{self.me}: no epoch admitted this worker within {timeout_s:.0f} s")

    def publish_deadline(self, seconds: float) -> None:
        """The deadline of the epochs formed from now on, the same for every member (set by one, read by all)."""
        self.store.set(DEADLINE_KEY, f"{seconds:.3f}")

    def pending_joins(self) -> int:
        """Join requests the current view has not answered (a store read: rank 0 asks, and tells the others)."""
        assert self.view is not None
        return self._count("joins") - self.view.joins_seen

    def _form(self, epoch: int, expected: int, previous: View | None, timeout_s: float | None = None) -> View:
        """Arrive at `epoch`; the first arrival waits for the others and publishes the view; every arrival reads it."""
        wait = timeout_s if timeout_s is not None else self.settle_s
        published = self._get(f"view/{epoch}", 0.0) if epoch > 0 else None
        if published is None:
            order = int(self.store.add(f"arrivals/{epoch}", 1))
            self.store.set(f"arrival/{epoch}/{order}", self.me)
            if order == 1:
                self._lead(epoch, expected, previous, wait)
            published = self._get(f"view/{epoch}", wait + self.settle_s + 2 * self.deadline)
            if published is None:  # the leader went quiet: the epoch is given up (a late view of it is refused)
                published = self._publish(epoch, ABANDONED)
        if published == ABANDONED:
            return self._form(epoch + 1, expected, previous, timeout_s)
        view = View.from_json(published)
        if self.me not in view.members:
            raise Dropped(f"{self.me}: epoch {view.epoch} formed without this worker")
        return self._enter(view)

    def _publish(self, epoch: int, value: bytes) -> bytes:
        """Set the epoch's view unless one was set (or the epoch given up) first; returns what the store holds."""
        return self.store.compare_set(f"view/{epoch}", "", value)

    def _lead(self, epoch: int, expected: int, previous: View | None, wait_s: float) -> None:
        """Wait for the arrivals (all expected, or the wait's end), then publish the epoch's view and its number."""
        end = time.monotonic() + wait_s
        while self._count(f"arrivals/{epoch}") < expected and time.monotonic() < end:
            time.sleep(0.01)
        arrived = self._arrived(epoch)
        held = False
        if previous is not None and not previous.held_for_rank_0 and previous.members[0] not in arrived:
            end += self.deadline
            while previous.members[0] not in arrived and time.monotonic() < end:
                time.sleep(0.01)
                arrived = self._arrived(epoch)
            held = previous.members[0] in arrived
        old = list(previous.members) if previous is not None else []
        # The first epoch admits no one: a worker that asked to join before the run began enters at its first
        # boundary, like any other, with the state the members reached.
        joins_seen, requests = (previous.joins_seen, self._count("joins")) if previous is not None else (0, 0)
        # A slot is named a moment after it is taken; one never named (its worker died between) is skipped.
        named = (self._get(f"join/{i}", self.settle_s) for i in range(joins_seen, requests))
        joining = [name.decode() for name in named if name is not None]
        # The first epoch ranks its workers by name (the driver names its own first); later ones keep the ranks of
        # those that stay and put newcomers last.
        members = [w for w in old if w in arrived] if previous is not None else sorted(arrived)
        admitted = [w for w in dict.fromkeys(joining) if w not in members]
        left = tuple(w for w in old if w not in arrived)
        view = View(epoch, tuple(members + admitted), tuple(admitted), left, requests, held)
        if self._publish(epoch, view.to_json().encode()) != view.to_json().encode():
            return  # the others gave this epoch up while its leader was quiet
        self.store.set("epoch", str(epoch))  # the latest epoch published, read with add(key, 0)
        if view.left or view.admitted:
            logger.warning(
                "epoch %d: %d worker(s)%s%s",
                epoch,
                len(view.members),
                f"; left: {', '.join(view.left)}" if view.left else "",
                f"; admitted: {', '.join(view.admitted)}" if view.admitted else "",
            )

    def _arrived(self, epoch: int) -> list[str]:
        """The workers arrived at the epoch, in order of arrival."""
        count = self._count(f"arrivals/{epoch}")
        return [self.store.get(f"arrival/{epoch}/{i}").decode() for i in range(1, count + 1)]

    def _enter(self, view: View) -> View:
        """Make the epoch's process group (its collectives bounded by the deadline) and take its view; a member that
        does not come to make it (a newcomer that left again) fails it for all: PeerLost, and the next epoch."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self.view = view
        if self.store.check([DEADLINE_KEY]):
            self.deadline = float(self.store.get(DEADLINE_KEY))
        try:
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore(f"group/{view.epoch}", self.store),
                rank=view.rank(self.me),
                world_size=len(view.members),
                timeout=datetime.timedelta(seconds=self.deadline),
            )
        except (RuntimeError, ValueError, TimeoutError) as error:
            raise PeerLost(f"epoch {view.epoch}: its group did not form ({error})") from error
        return view

    @contextlib.contextmanager
    def allowing(self, seconds: float) -> Iterator[None]:
        """The current group's collectives bounded by `seconds` (never less than the deadline) inside the block, by
        the deadline again after it: for a transfer the deadline was not measured for (a state many times the
        gradient's size), which would otherwise fail at every membership and the next would try it again."""
        set_group_timeout(max(seconds, self.deadline))
        try:
            yield
        finally:
            set_group_timeout(self.deadline)

    def source(self, progress: int) -> tuple[int, bool]:
        """After an epoch forms (a collective of its group): the rank whose state every member takes, the one
        furthest along (`progress`: its completed steps; a newcomer's -1), and whether any member is elsewhere."""
        import torch
        import torch.distributed as dist

        mine = torch.tensor([progress], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        values = [int(v) for v in every]
        furthest = max(values)
        return values.index(furthest), any(v != furthest for v in values)

    # -- rank 0's work alone -----------------------------------------------------------------------------------------

    def release(self, tag: str) -> None:
        """Rank 0 is done with work it does alone (an evaluation, tagged uniquely in the epoch): the members that
        hold for it go on."""
        self.store.set(f"released/{self._epoch()}/{tag}", "1")

    def hold(self, tag: str, timeout_s: float = HOLD_S) -> None:
        """Wait until rank 0 releases `tag`. Its work alone may outlast the deadline that bounds the group's
        collectives, where a member waiting would take rank 0 for lost; the store's wait has no such bound.
        PeerLost past timeout_s."""
        epoch = self._epoch()
        if self._get(f"released/{epoch}/{tag}", timeout_s) is None:
            raise PeerLost(f"epoch {epoch}: rank 0 did not finish {tag} in {timeout_s:.0f} s")

    def _epoch(self) -> int:
        if self.view is None:
            raise RuntimeError("no epoch yet: start, regroup or join first")
        return self.view.epoch

    def leave(self, finished: bool = True) -> None:
        """This worker's group, closed; at the run's end (`finished`) a worker still trying to join is told so."""
        import torch.distributed as dist

        if finished:
            self.store.set(FINISHED, "1")
        if dist.is_initialized():
            dist.destroy_process_group()
