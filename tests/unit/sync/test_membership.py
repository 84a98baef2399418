"""The run's membership (raytrm.sync.membership): a worker that stops answering costs the others one deadline, the
others go on without a restart, and a worker that comes back enters at a round boundary with a live peer's state."""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import pytest

from raytrm.sync.membership import MIN_DEADLINE_S, Membership, PeerLost, View, deadline_s, is_peer_lost
from tests.support.elastic_rounds import Run

NAMES = ["studio", "air", "mini"]


def test_deadline_is_grace_times_the_sum_and_a_step_never_under_the_floor():
    assert deadline_s(0.1, 0.2) == pytest.approx(max(0.9, MIN_DEADLINE_S))
    assert deadline_s(1.0, 2.0) == pytest.approx(9.0)
    assert deadline_s(0.0, 0.0) == MIN_DEADLINE_S


def test_view_round_trips():
    view = View(3, ("air", "mini", "studio"), admitted=("air",), left=("old",), joins_seen=2, held_for_rank_0=True)
    assert View.from_json(view.to_json().encode()) == view
    assert view.rank("studio") == 2


def _in_epoch(store, name, epoch):
    member = Membership(store, name)
    member.view = View(epoch, ("studio", "air"))
    return member


@pytest.mark.slow
def test_a_member_holds_for_rank_0s_work_alone_past_the_deadline_until_it_is_released():
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timeout)  # a client each, as workers
    rank0, other = _in_epoch(store, "studio", 4), _in_epoch(client, "air", 4)
    work_s = 3 * MIN_DEADLINE_S  # longer than a collective's deadline
    threading.Timer(work_s, rank0.release, args=("eval/20",)).start()
    begin = time.monotonic()
    other.hold("eval/20")
    assert work_s <= time.monotonic() - begin < work_s + 5
    # a tag is released in its epoch only, and a hold that is never released ends
    later = _in_epoch(client, "air", 5)
    with pytest.raises(PeerLost, match=r"epoch 5: rank 0 did not finish eval/20 in 1 s"):
        later.hold("eval/20", timeout_s=1.0)


def _arrive_later(store, epoch: int, name: str, after_s: float) -> threading.Timer:
    """A member arriving at the epoch after_s from now, as `Membership._form` arrives."""

    def arrive() -> None:
        order = int(store.add(f"arrivals/{epoch}", 1))
        store.set(f"arrival/{epoch}/{order}", name)

    timer = threading.Timer(after_s, arrive)
    timer.start()
    return timer


@pytest.mark.parametrize(
    ("late", "held_before", "stays"),
    [
        ("studio", False, True),  # rank 0, a deadline late: held for
        ("mini", False, False),  # another member as late: left behind, to come back at a boundary
        ("studio", True, False),  # rank 0 late again right after it was held for: the others go on
    ],
)
def test_a_forming_epoch_holds_a_deadline_longer_for_the_old_rank_0_once(late, held_before, stays):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    settle, deadline = 0.2, 1.0
    leader = Membership(store, "air", deadline=deadline, settle_s=settle)
    previous = View(4, ("studio", "air", "mini"), held_for_rank_0=held_before)
    store.add("arrivals/5", 1)
    store.set("arrival/5/1", "air")
    on_time = next(n for n in ("studio", "mini") if n != late)
    _arrive_later(store, 5, on_time, 0.05)
    late_arrival = _arrive_later(store, 5, late, settle + deadline / 2)  # past the settle, inside the hold
    begin = time.monotonic()
    leader._lead(5, expected=3, previous=previous, wait_s=settle)
    waited = time.monotonic() - begin
    late_arrival.join()
    view = View.from_json(store.get("view/5"))
    assert (late in view.members) == stays and view.held_for_rank_0 == (stays and late == "studio")
    assert view.left == (() if stays else (late,))
    # held: until the late one came, within the deadline's hold; not held: published before it came
    assert (waited >= settle + deadline / 2) == stays and waited < settle + deadline + 0.5


def _late_transfers(rank: int, world_size: int, device) -> dict[str, object]:
    """Two broadcasts from rank 0, which starts each 2.5 s late, in a group whose deadline is 1 s: the first allowed
    6 s, the second bounded by the deadline again; what rank 1 received, or whether it took rank 0 for lost."""
    import torch
    import torch.distributed as dist

    members = Membership(None, f"w{rank}", deadline=1.0)
    with members.allowing(0.0):  # never under the deadline: the group's collectives are bounded by 1 s from here
        pass
    got: dict[str, object] = {}
    for name, seconds in (("allowed", 6.0), ("after", 0.0)):
        value = torch.zeros(1)
        if rank == 0:
            time.sleep(2.5)
            value += 7
        try:
            with members.allowing(seconds):
                dist.broadcast(value, src=0)
            got[name] = float(value)
        except RuntimeError as error:
            got[name] = "lost" if is_peer_lost(error) else str(error)
            break
    return got


@pytest.mark.slow  # two processes and their gloo group
def test_a_transfer_allowed_longer_than_the_deadline_completes_and_the_deadline_holds_after_it():
    from raytrm.distributed.launch import spawn

    _, receiver = spawn(_late_transfers, 2, timeout_s=120)
    assert receiver == {"allowed": 7.0, "after": "lost"}


def _a_sum_one_peer_skips(rank: int, world_size: int, device, retime_s: float | None) -> dict[str, object]:
    """A round's sum (ProcessGroupSync.sum_tensors, in the group made for bulk sums) that rank 1 never joins, in a run
    whose deadline is 1 s (or retime_s, set on the live groups after the bulk group was made): how long rank 0 waited
    and whether it took rank 1 for lost."""
    import torch

    from raytrm.sync.process_group import ProcessGroupSync

    with Membership(None, f"w{rank}", deadline=1.0).allowing(0.0):  # the default group's collectives: 1 s from here
        pass
    sync = ProcessGroupSync(torch.device("cpu"))
    deltas = [torch.ones(1000)]
    sync.sum_tensors(deltas).wait()  # both: the bulk group made, a first round summed
    if retime_s is not None:
        sync.set_timeout(retime_s)
    if rank == 1:  # asleep for the next round
        time.sleep(3 + (retime_s or 0))
        return {}
    begin = time.monotonic()
    try:
        sync.sum_tensors(deltas).wait()
    except RuntimeError as error:
        return {"waited": time.monotonic() - begin, "lost": is_peer_lost(error), "summed": float(deltas[0][0])}
    return {"waited": time.monotonic() - begin, "lost": False}


@pytest.mark.slow  # two processes and their gloo group
@pytest.mark.parametrize("retime_s", [None, 2.5])
def test_a_rounds_sum_a_peer_never_joins_gives_up_at_the_runs_deadline(retime_s):
    from raytrm.distributed.launch import spawn

    waiter, _ = spawn(_a_sum_one_peer_skips, 2, retime_s, timeout_s=120)
    deadline = retime_s or 1.0
    assert waiter["lost"]  # not torch's 30-minute default for a group made beside the run's
    assert deadline - 0.1 <= waiter["waited"] < deadline + 1.0


def test_gloo_words_for_a_lost_peer_are_recognised():
    assert is_peer_lost(RuntimeError("[gloo/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation"))
    assert is_peer_lost(RuntimeError("[gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:7557"))
    assert not is_peer_lost(RuntimeError("CUDA out of memory"))
    assert not is_peer_lost(ValueError("Timed out"))


@pytest.fixture
def run_of():
    runs = []

    def make(plan: dict) -> Run:
        runs.append(Run(plan))
        return runs[-1]

    yield make
    for run in runs:
        run.close()


def _assert_every_round_once(logs: list[dict], rounds: int | None = None) -> None:
    """Every round was summed in one epoch, by members of it only, and every worker at the end holds the sum of each
    round's epoch size: nothing lost, nothing counted twice, whoever was left behind when."""
    epochs: dict[int, set[tuple[int, int]]] = {}
    for log in logs:
        for r, epoch, size in log["rounds"]:
            epochs.setdefault(r, set()).add((epoch, size))
    assert sorted(epochs) == list(range(rounds if rounds is not None else max(epochs) + 1))
    assert all(len(summed) == 1 for summed in epochs.values()), "a round summed in two epochs"
    total = sum(size for (summed,) in epochs.values() for _, size in [summed])
    for log in logs:
        if not log.get("finished_outside"):
            assert log["w"] == total


@pytest.mark.slow  # worker processes and a stopped one's deadline
def test_a_stopped_worker_costs_one_deadline_and_rejoins_with_the_live_state(run_of):
    deadline, settle = 3.0, 1.0
    run = run_of({"size": 3, "rounds": 10**9, "deadline": deadline, "settle": settle, "pace": 0.02})
    for name in NAMES:
        run.start(name)
    run.wait("ready", 3)
    time.sleep(0.5)
    os.kill(run.pids["mini"], signal.SIGSTOP)  # a lid closed
    time.sleep(2 * deadline + settle)
    os.kill(run.pids["mini"], signal.SIGCONT)  # opened again
    run.admitted("mini")
    time.sleep(0.5)
    run.stop()
    run.wait("done", 3)

    studio, air, mini = (run.logs[n] for n in NAMES)
    for log in (studio, air):
        assert max(log["waits"]) < deadline + 1.0  # the collective gave up at its deadline, not gloo's 30 minutes
        assert max(log["regroups"]) < settle + 1.0  # and the next epoch formed within the settling time
    assert mini.get("dropped", 0) >= 1
    # the others went on in an epoch of two, then took mini back; none restarted
    sizes = [len(members) for _, members in studio["epochs"]]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3
    # every round's sum was summed once, by the members of its epoch, and the rejoined worker holds the live state
    _assert_every_round_once([studio, air, mini])
    assert studio["w"] == air["w"] == mini["w"]
    assert studio["final_epoch"] == air["final_epoch"] == mini["final_epoch"]


@pytest.mark.slow  # a thousand rounds in worker processes
def test_a_thousand_rounds_with_delays_never_hang_and_account_for_every_round(run_of):
    deadline = 2.0
    plan = {
        "size": 3,
        "rounds": 1000,
        "deadline": deadline,
        "settle": 1.0,
        "delay_every": 50,
        "delays": [0.5, 4.0],  # one inside the deadline (waited for), one past it (left behind, then back)
        "names": NAMES,
        "seed": 7,
    }
    run = run_of(plan)
    for name in NAMES:
        run.start(name)
    run.wait("ready", 3)
    run.wait("done", 3, timeout=300)
    logs = [run.logs[n] for n in NAMES]
    for log in logs:
        assert max(log["waits"]) < deadline + 1.0
    # those in the run at its end hold the same weights (one left behind at the very end may find the run over)
    at_end = [log for log in logs if not log.get("finished_outside")]
    assert len({log["w"] for log in at_end}) == 1
    assert len({log["final_epoch"] for log in at_end}) == 1
    _assert_every_round_once(logs, 1000)
    assert any(log.get("dropped") for log in logs)  # a delay past the deadline left someone behind


@pytest.mark.slow  # worker processes
def test_a_new_worker_joins_mid_run_with_the_live_state(run_of):
    run = run_of({"size": 2, "rounds": 10**9, "deadline": 3.0, "settle": 1.0, "pace": 0.02})
    run.start("studio")
    run.start("air")
    run.wait("ready", 2)
    time.sleep(0.5)
    run.start("mini", join=True)
    run.wait("ready", 1)
    run.admitted("mini")
    time.sleep(0.5)
    run.stop()
    run.wait("done", 3)
    studio, air, mini = (run.logs[n] for n in NAMES)
    assert [len(m) for _, m in studio["epochs"]] == [2, 3]
    assert mini["epochs"][0][0] == 1 and mini["rounds"][0][0] > 0  # entered mid-run, at a boundary
    assert studio["w"] == air["w"] == mini["w"]
    _assert_every_round_once([studio, air, mini])
