"""AdamATan2, SignSGD on sparse rows, and the weight EMA."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from raytrm.models.layers import SparseEmbedding
from raytrm.models.sign_sgd import SignSGD, sparse_signsgd_
from raytrm.train.optim import AdamATan2, ModelEMA


def test_adam_atan2_matches_the_scalar_recurrence():
    lr, (b1, b2), wd = 0.01, (0.9, 0.95), 0.1
    grads = [0.5, -0.2, 0.0, 1.5, -3.0]
    p = nn.Parameter(torch.tensor([0.3], dtype=torch.float64))
    opt = AdamATan2([p], lr=lr, betas=(b1, b2), weight_decay=wd)
    x, m, v = 0.3, 0.0, 0.0
    for t, g in enumerate(grads, start=1):
        p.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
        x *= 1 - lr * wd
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        x -= lr / (1 - b1**t) * math.atan2(m, math.sqrt(v) / math.sqrt(1 - b2**t))
        assert math.isclose(p.item(), x, rel_tol=1e-12, abs_tol=1e-15), t


def test_adam_atan2_resumes_from_its_state_dict():
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(4, 3))
    b = nn.Parameter(a.detach().clone())
    opt_a = AdamATan2([a], lr=0.1, betas=(0.9, 0.95), weight_decay=0.5)
    opt_b = AdamATan2([b], lr=0.1, betas=(0.9, 0.95), weight_decay=0.5)
    grads = [torch.randn(4, 3) for _ in range(4)]
    for g in grads[:2]:
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    resumed = AdamATan2([b], lr=0.0)
    resumed.load_state_dict(opt_b.state_dict())
    for g in grads[2:]:
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        resumed.step()
    assert torch.equal(a, b)
    assert float(resumed.state[b]["step"]) == 4


def test_adam_atan2_skips_parameters_without_gradients():
    p = nn.Parameter(torch.ones(2))
    AdamATan2([p], lr=1.0, weight_decay=1.0).step()
    assert torch.equal(p, torch.ones(2))


def test_signsgd_updates_only_seen_rows_with_decoupled_decay():
    emb = SparseEmbedding(5, 2).train()
    with torch.no_grad():
        emb.weight.copy_(torch.arange(10.0).view(5, 2))
    before = emb.weight.clone()
    opt = SignSGD(emb, lr=0.1, weight_decay=0.5)
    # Two accumulated forwards: row 1 is seen in both, and its grads sum before the sign.
    (emb(torch.tensor([1, 3])) * torch.tensor([[2.0, -1.0], [1.0, 1.0]])).sum().backward()
    (emb(torch.tensor([1])) * torch.tensor([[-3.0, -1.0]])).sum().backward()
    opt.step()
    decay = 1 - 0.1 * 0.5
    expected = before.clone()
    expected[1] = before[1] * decay - 0.1 * torch.tensor([-1.0, -1.0])  # sign(2 - 3), sign(-1 - 1)
    expected[3] = before[3] * decay - 0.1 * torch.tensor([1.0, 1.0])
    torch.testing.assert_close(emb.weight, expected)
    assert emb.sparse_grad() is None  # the step consumed the rows
    assert list(emb.parameters()) == []


def test_signsgd_lr_property_gather_hook_and_state_dict():
    emb = SparseEmbedding(3, 1).train()
    seen = []

    def gather(ids, grads):
        seen.append(ids.tolist())
        return torch.cat([ids, torch.tensor([2])]), torch.cat([grads, torch.tensor([[-1.0]])])

    opt = SignSGD([emb], lr=1.0, weight_decay=0.0, gather=gather)
    opt.lr = 0.5
    assert all(g["lr"] == 0.5 for g in opt.param_groups)
    emb(torch.tensor([0])).sum().backward()
    opt.step()
    assert seen == [[0]] and emb.weight.view(-1).tolist() == [-0.5, 0.0, 0.5]
    # No row of its own since: a gather is a collective, so it still takes part, and the rows the other workers
    # touched (here row 2) move on every worker alike.
    opt.step()
    assert seen == [[0], []] and emb.weight.view(-1).tolist() == [-0.5, 0.0, 1.0]
    alone = SignSGD(emb, lr=1.0)
    alone.step()  # without a gather and without rows: nothing moves
    assert emb.weight.view(-1).tolist() == [-0.5, 0.0, 1.0]
    again = SignSGD(emb, lr=1.0)
    again.load_state_dict(opt.state_dict())
    assert again.lr == 0.5


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.frozen = nn.Parameter(torch.zeros(2), requires_grad=False)
        self.register_buffer("buf", torch.zeros(2))


def test_ema_math_swap_and_state():
    net = _Net()
    ema = ModelEMA(net, decay=0.9)
    assert set(ema.shadow) == {"a.weight", "a.bias"}
    w0 = net.a.weight.detach().clone()
    with torch.no_grad():
        net.a.weight.add_(1.0)
    ema.update(net)
    torch.testing.assert_close(ema.shadow["a.weight"], 0.9 * w0 + 0.1 * (w0 + 1.0))
    with torch.no_grad():
        net.a.weight.add_(1.0)
    ema.update(net)
    expected = 0.9 * (0.9 * w0 + 0.1 * (w0 + 1.0)) + 0.1 * (w0 + 2.0)
    torch.testing.assert_close(ema.shadow["a.weight"], expected)
    live = net.a.weight.detach().clone()
    with ema.swapped(net) as swapped:
        assert swapped is net
        torch.testing.assert_close(net.a.weight.detach(), expected)
    assert torch.equal(net.a.weight, live)
    restored = ModelEMA(_Net(), decay=0.5)
    restored.load_state_dict(ema.state_dict())
    assert restored.decay == 0.9 and torch.equal(restored.shadow["a.weight"], ema.shadow["a.weight"])


def test_ema_warmup_ramps_the_decay():
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    ema = ModelEMA(model, decay=0.999, warmup=True)
    expected = 0.0
    for n in range(5):
        with torch.no_grad():
            model.weight.fill_(float(n + 1))
        ema.update(model)
        decay = min(0.999, (1 + n) / (10 + n))
        expected = decay * expected + (1 - decay) * (n + 1)
        assert ema.shadow["weight"].item() == pytest.approx(expected, rel=1e-6)
    state = ema.state_dict()
    again = ModelEMA(model, decay=0.5)
    again.load_state_dict(state)
    assert (again.decay, again.warmup, again.updates) == (0.999, True, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_signsgd_equals_the_update_over_distinct_rows(dtype):
    """Bit for bit the formula over torch.unique's distinct ids, repeated ids in any order, grads summed in order."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(50, 8, generator=gen)
    ids = torch.randint(0, 50, (300,), generator=gen)
    grads = torch.randn(300, 8, generator=gen).to(dtype)
    grads[ids == ids[0]] = 0.0  # a row whose grads sum to zero keeps only its decay
    expected = table.clone()
    unique, inverse = ids.unique(return_inverse=True)
    summed = grads.new_zeros(len(unique), 8).index_add_(0, inverse, grads)
    expected[unique] = expected[unique] * (1 - 0.1 * 0.5) - 0.1 * summed.sign().float()
    sparse_signsgd_(table, ids, grads, lr=0.1, weight_decay=0.5)
    assert torch.equal(table, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sparse_signsgd_never_waits_for_the_gpu():
    table = torch.zeros(1000, 16, device="cuda")
    ids = torch.randint(0, 1000, (768,), device="cuda")
    grads = torch.randn(768, 16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sparse_signsgd_(table, ids, grads, lr=0.1, weight_decay=0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert table.abs().sum().item() > 0


def test_ema_fold_of_one_value_many_times_is_that_many_updates():
    # A local round's synchronized weights are folded in once per inner step, in one pass.
    model, twin = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    twin.load_state_dict(model.state_dict())
    folded, stepped = ModelEMA(model, decay=0.99, warmup=True), ModelEMA(twin, decay=0.99, warmup=True)
    with torch.no_grad():
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            p.add_(1.0)
            q.add_(1.0)
    folded.fold(model.named_parameters(), times=7)
    for _ in range(7):
        stepped.update(twin)
    assert folded.updates == stepped.updates == 7
    for name, value in stepped.shadow.items():
        torch.testing.assert_close(folded.shadow[name], value, rtol=1e-6, atol=1e-6)
