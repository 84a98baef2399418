"""Local rounds' puzzle-table rows: each worker's rows move on it alone during a round, and at the round's end each
touched row is its round-start value plus the mean delta of the workers that moved it (one process; the other
worker's rows are scripted)."""

from __future__ import annotations

import torch

from raytrm.models.layers import SparseEmbedding
from raytrm.models.sign_sgd import SignSGD
from raytrm.sync.local import RoundRows


class ScriptedPeer:
    """gather_rows as two workers: this one's rows, then the peer's scripted (ids, deltas)."""

    def __init__(self, ids, deltas):
        self.theirs = (ids, deltas)

    def gather_rows(self, ids, grads):
        return torch.cat([ids, self.theirs[0]]), torch.cat([grads, self.theirs[1]])


def test_rows_are_their_round_start_plus_the_mean_delta_of_the_workers_that_moved_them():
    table = SparseEmbedding(5, 3)
    with torch.no_grad():
        table.weight.copy_(torch.arange(15.0).view(5, 3))
    start = table.weight.clone()
    optimizer = SignSGD(table, lr=0.5)
    theirs = torch.tensor([[0.25, 0.25, 0.25], [-1.0, -1.0, -1.0]])  # the peer moved rows 1 and 2
    rows = RoundRows(optimizer, ScriptedPeer(torch.tensor([1, 2]), theirs))
    for ids in ([0, 1], [1], [0]):  # this worker's steps touch rows 0 and 1, row 0 twice
        table.train()
        table(torch.tensor(ids)).sum().backward()
        optimizer.step()
    mine = table.weight - start
    assert mine[0].abs().sum() > 0 and mine[1].abs().sum() > 0 and mine[2:].abs().sum() == 0
    rows.exchange()
    expected = start.clone()
    expected[0] += mine[0]  # moved here alone
    expected[1] += (mine[1] + theirs[0]) / 2  # moved by both
    expected[2] += theirs[1]  # moved by the peer alone
    torch.testing.assert_close(table.weight, expected)
    assert not rows.touched[0].any() and rows.ids == [[]]  # the next round starts afresh
    rows.close()
    assert optimizer.gather is None
