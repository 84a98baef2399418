"""Compressed gradient sums with error feedback, on a gloo group of one process (fast: no worker processes): what a
worker sends over the steps adds up to the sum of its gradients, less only the residual it holds; an abandoned
round leaves the residual alone; the first exact sum after compression carries what was left unsent."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from raytrm.distributed.launch import free_port
from raytrm.sync.process_group import ProcessGroupSync


@pytest.fixture
def group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _params(sizes=(300, 7, 1000)):
    return [torch.nn.Parameter(torch.zeros(n)) for n in sizes]


def _gradients(params, gen):
    # Entries over many orders of magnitude: bf16 keeps 8 bits of each, the residual the rest.
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * torch.exp(4 * torch.randn(p.shape, generator=gen))


def test_what_is_sent_adds_up_to_the_gradients_less_the_residual(group):
    params = _params()
    sync = ProcessGroupSync(torch.device("cpu"), bucket_mb=0.001)  # several buckets
    sync.set_compression(True)
    assert sync.wire_dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    sent = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    total = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    size = [torch.zeros(p.shape, dtype=torch.float64) for p in params]  # each entry's sum of |gradient|
    for _ in range(20):
        _gradients(params, gen)
        for t, m, p in zip(total, size, params, strict=True):
            t += p.grad.double()
            m += p.grad.double().abs()
        sync.all_reduce_gradients(params)  # one worker: its sum is what it sent
        for s, p in zip(sent, params, strict=True):
            assert torch.equal(p.grad, p.grad.bfloat16().float())  # it travelled in bf16
            s += p.grad.double()
    residual = sync.compression_state()
    assert residual is not None and residual.abs().max() > 0
    # The residual is in bucket order: last parameter first.
    flat_sent = torch.cat([s.flatten() for s in reversed(sent)])
    flat_total = torch.cat([t.flatten() for t in reversed(total)])
    scale = torch.cat([m.flatten() for m in reversed(size)])
    # Within fp32's rounding of each step's addition, entry by entry.
    assert float(((flat_sent + residual.double() - flat_total).abs() / scale).max()) <= 2e-6
    # What is left unsent is one step's bf16 rounding, not twenty: the feedback keeps it from piling up.
    assert float((residual.double().abs() / scale).max()) <= 2**-8
    assert float(((flat_sent - flat_total).abs() / scale).max()) > 1e-4


def test_exact_again_carries_the_residual_then_holds_none(group):
    params = _params((64,))
    sync = ProcessGroupSync(torch.device("cpu"))
    sync.set_compression(True)
    gen = torch.Generator().manual_seed(1)
    _gradients(params, gen)
    sync.all_reduce_gradients(params)
    residual = sync.compression_state().clone()
    sync.set_compression(False)
    _gradients(params, gen)
    expected = params[0].grad + residual
    sync.all_reduce_gradients(params)
    torch.testing.assert_close(params[0].grad, expected, rtol=0, atol=0)
    assert sync.compression_state() is None


def test_an_abandoned_round_leaves_the_residual_and_a_saved_one_reloads(group):
    params = _params((100, 50))
    sync = ProcessGroupSync(torch.device("cpu"), bucket_mb=0.0002)
    sync.set_compression(True)
    gen = torch.Generator().manual_seed(2)
    _gradients(params, gen)
    sync.all_reduce_gradients(params)
    before = sync.compression_state().clone()
    reducer = sync.overlapped(params)
    reducer.start()
    _gradients(params, gen)
    reducer.abandon()  # this rank failed part-way: its buckets went out, nothing is kept
    torch.testing.assert_close(sync.compression_state(), before, rtol=0, atol=0)
    reducer.close()

    fresh = ProcessGroupSync(torch.device("cpu"), bucket_mb=0.0002)
    fresh.load_compression_state(before)  # before the buckets are planned: kept until the first sum
    torch.testing.assert_close(fresh.compression_state(), before, rtol=0, atol=0)
    fresh.set_compression(True)
    _gradients(params, gen)
    grads = [p.grad.clone() for p in params]
    fresh.all_reduce_gradients(params)
    # The reloaded residual was added before rounding: sent + new residual = gradient + old residual.
    sent = torch.cat([p.grad for p in reversed(params)])
    wanted = torch.cat([g for g in reversed(grads)]) + before
    torch.testing.assert_close(sent + fresh.compression_state(), wanted, rtol=1e-6, atol=1e-6)


def test_a_gradient_of_one_bucket_is_summed_after_the_backward_not_during_it(group):
    """One bucket leaves only when the backward ends: no overlapped sum (the step keeps its threads side by side);
    several buckets: the overlapped sum, its first buckets leaving during the backward."""
    one = ProcessGroupSync(torch.device("cpu"), bucket_mb=1.0)
    assert len(one.buckets(_params())) == 1
    assert one.overlapped(_params()) is None
    several = ProcessGroupSync(torch.device("cpu"), bucket_mb=0.001)
    params = _params()
    reducer = several.overlapped(params)
    assert len(several.buckets(params)) == 3 and reducer is not None
    reducer.close()
    assert ProcessGroupSync(torch.device("cpu"), bucket_mb=0.001, overlap=False).overlapped(params) is None
