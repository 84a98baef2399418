"""TRM fidelity: parameter counts, equivalence with an independent re-statement of the reference, ACT carry."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from raytrm.config import ModelConfig
from raytrm.models import TRM, Carry, Exploration, act_loss, to_reference_state_dict
from raytrm.models.trm import rows

SUDOKU = {"vocab_size": 11, "seq_len": 81, "num_puzzle_identifiers": 1}
SMALL = {
    "hidden_size": 64,
    "num_heads": 4,
    "expansion": 4.0,
    "L_layers": 2,
    "H_cycles": 2,
    "L_cycles": 2,
    "puzzle_emb_len": 4,
    "halt_max_steps": 4,
}
VARIANTS = [("mlp_t", "none"), ("attention", "rope"), ("attention", "learned"), ("mlp_t", "learned")]


def small_model(variant: str, pos: str, seed: int = 0, **overrides) -> TRM:
    torch.manual_seed(seed)
    config = ModelConfig(variant=variant, pos_encodings=pos, **{**SMALL, **overrides})
    model = TRM(config, vocab_size=11, seq_len=9, num_puzzle_identifiers=3)
    with torch.no_grad():
        # Non-trivial values where the reference starts from constants, so the check covers their equations too.
        model.q_head.weight.normal_(std=0.1)
        model.q_head.bias.normal_()
        model.puzzle_emb.weight.normal_()
    return model


def make_batch(B: int, seq_len: int = 9, vocab: int = 11, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (B, seq_len), generator=g)
    labels[:, -2:] = -100
    return {
        "inputs": torch.randint(0, vocab, (B, seq_len), generator=g),
        "labels": labels,
        "puzzle_identifiers": torch.randint(0, 3, (B,), generator=g),
    }


# -- an independent re-statement of the reference equations, from reference-layout weights ---------------------


def _rms(x, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _swiglu(x, w_gate_up, w_down):
    h = x @ w_gate_up.T
    inner = h.shape[-1] // 2
    gate, up = h[..., :inner], h[..., inner:]
    return (gate * torch.sigmoid(gate) * up) @ w_down.T


def _rope_tables(head_dim, positions, theta):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2).double() / head_dim)
    ang = torch.arange(positions).double()[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def _attention(x, w_qkv, w_o, heads, rope):
    B, L, D = x.shape
    hd = D // heads
    qkv = (x @ w_qkv.T).view(B, L, 3, heads, hd)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if rope is not None:
        cos, sin = rope[0][:, None, :], rope[1][:, None, :]

        def rot(t):
            return t * cos + torch.cat([-t[..., hd // 2 :], t[..., : hd // 2]], dim=-1) * sin

        q, k = rot(q), rot(k)
    scores = torch.einsum("blhd,bmhd->bhlm", q, k) / math.sqrt(hd)
    out = torch.einsum("bhlm,bmhd->blhd", torch.softmax(scores, dim=-1), v)
    return out.reshape(B, L, D) @ w_o.T


def reference_step(sd, cfg: ModelConfig, z_H, z_L, inputs, puzzle_ids, rope):
    """One supervision step of the reference inner model, batch-first, plain tensor ops."""
    w = {k.removeprefix("_orig_mod.model.inner."): v for k, v in sd.items()}
    D, P, eps = cfg.hidden_size, cfg.puzzle_emb_len, cfg.rms_norm_eps
    emb = w["embed_tokens.embedding_weight"][inputs]
    puzzle = w["puzzle_emb.weights"][puzzle_ids]
    padding = puzzle.new_zeros(puzzle.shape[0], P * D - puzzle.shape[1])
    puzzle = torch.cat([puzzle, padding], dim=-1).view(-1, P, D)
    emb = torch.cat([puzzle, emb], dim=1)
    if cfg.pos_encodings == "learned":
        emb = 0.707106781 * (emb + w["embed_pos.embedding_weight"])
    x = math.sqrt(D) * emb

    def net(h, inject):
        h = h + inject
        for i in range(cfg.L_layers):
            pre = f"L_level.layers.{i}."
            if cfg.variant == "mlp_t":
                ht = h.transpose(1, 2)
                ht = _rms(
                    ht + _swiglu(ht, w[pre + "mlp_t.gate_up_proj.weight"], w[pre + "mlp_t.down_proj.weight"]), eps
                )
                h = ht.transpose(1, 2)
            else:
                a = _attention(
                    h, w[pre + "self_attn.qkv_proj.weight"], w[pre + "self_attn.o_proj.weight"], cfg.num_heads, rope
                )
                h = _rms(h + a, eps)
            h = _rms(h + _swiglu(h, w[pre + "mlp.gate_up_proj.weight"], w[pre + "mlp.down_proj.weight"]), eps)
        return h

    for _ in range(cfg.H_cycles):
        for _ in range(cfg.L_cycles):
            z_L = net(z_L, z_H + x)
        z_H = net(z_H, z_L)
    logits = z_H[:, P:] @ w["lm_head.weight"].T
    q = z_H[:, 0] @ w["q_head.weight"].T + w["q_head.bias"]
    return z_H, z_L, logits, q[:, 0]


def reference_loss(logits, q_halt, labels, global_batch_size):
    x = logits.double()
    s = torch.where(x < 0, 1 / (1 - x), x + 1)
    logp = torch.log(s / s.sum(-1, keepdim=True))
    valid = labels != -100
    nll = -torch.where(valid, logp.gather(-1, labels.clamp_min(0)[..., None])[..., 0], 0)
    lm = (nll.sum(-1) / valid.sum(-1).clamp_min(1)).sum()
    right = ((logits.argmax(-1) == labels) | ~valid).all(-1).float()
    bce = F.binary_cross_entropy_with_logits(q_halt, right, reduction="sum")
    return (lm + 0.5 * bce) / global_batch_size


# -- tests ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variant", "pos", "expected"), [("mlp_t", "none", 5_028_866), ("attention", "rope", 6_828_034)]
)
def test_parameter_counts_match_the_reference(variant, pos, expected):
    model = TRM(ModelConfig(variant=variant, pos_encodings=pos), **SUDOKU)
    assert model.num_parameters() == expected == sum(p.numel() for p in model.parameters())


def test_puzzle_table_is_a_zero_buffer_outside_the_parameters():
    model = TRM(ModelConfig(), **SUDOKU)
    table = model.puzzle_emb.weight
    assert table.shape == (1, 512) and not table.any()
    assert all(p.data_ptr() != table.data_ptr() for p in model.parameters())
    assert "puzzle_emb.weight" in model.state_dict()
    assert not model.q_head.weight.any() and torch.all(model.q_head.bias == -5)
    assert isinstance(model.z_H_init, torch.Tensor) and "z_H_init" not in dict(model.named_parameters())


def test_a_cpu_step_compiles_its_round_alone_and_a_cuda_step_its_edges_too():
    model = small_model("attention", "rope")
    assert model.compile_regions == ("_round",)
    if torch.cuda.is_available():
        assert model.cuda().compile_regions == ("_round", "_start", "_finish")


@pytest.mark.parametrize(("variant", "pos"), VARIANTS)
def test_two_steps_match_the_reference_equations(variant, pos):
    model = small_model(variant, pos).eval()  # eval: no slot halts before halt_max_steps, so states carry over
    cfg = model.config
    # The re-statement runs in float64 from the same weights: the ground truth both fp32 programs approximate.
    sd = {k: v.double() for k, v in to_reference_state_dict(model.state_dict()).items()}
    rope = None
    if pos == "rope":
        rope = _rope_tables(cfg.hidden_size // cfg.num_heads, 9 + cfg.puzzle_emb_len, cfg.rope_theta)
    batch = make_batch(3)
    carry = model.initial_carry(batch)
    shape = (3, 9 + cfg.puzzle_emb_len, cfg.hidden_size)
    z_H, z_L = sd["_orig_mod.model.inner.H_init"].expand(shape), sd["_orig_mod.model.inner.L_init"].expand(shape)
    with torch.no_grad():
        for step in range(2):
            # fp32 rounding, amplified by the recursion, reaches ~1e-5 after one step (a plain fp32 re-statement
            # is off by as much) and ~1e-4 after two (1.6e-4 with a 16-thread BLAS, which sums in another order);
            # an error in an equation would be off by ~1e-1.
            tol = {"rtol": 1e-5, "atol": 2e-5} if step == 0 else {"rtol": 1e-4, "atol": 3e-4}
            carry, out = model(carry, batch)
            z_H, z_L, logits, q_halt = reference_step(
                sd, cfg, z_H, z_L, batch["inputs"], batch["puzzle_identifiers"], rope
            )
            torch.testing.assert_close(out["logits"].double(), logits, **tol)
            torch.testing.assert_close(out["q_halt_logits"].double(), q_halt, **tol)
            torch.testing.assert_close(carry.z_H.double(), z_H, **tol)
            torch.testing.assert_close(carry.z_L.double(), z_L, **tol)
            loss, _ = act_loss(out, carry, global_batch_size=5)
            torch.testing.assert_close(loss, reference_loss(logits, q_halt, batch["labels"], 5), **tol)
            assert carry.steps.tolist() == [step + 1] * 3


def test_carry_is_detached_and_the_step_backpropagates():
    model = small_model("attention", "rope").train()
    batch = make_batch(2)
    carry, out = model(model.initial_carry(batch), batch)
    assert not carry.z_H.requires_grad and not carry.z_L.requires_grad
    loss, _ = act_loss(out, carry, global_batch_size=2)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    ids, grads = model.puzzle_emb.sparse_grad()
    assert ids.tolist() == batch["puzzle_identifiers"].tolist() and grads.abs().sum() > 0


@pytest.mark.parametrize(("variant", "pos"), [("attention", "rope"), ("mlp_t", "none")])
def test_a_carry_of_states_left_in_cuda_graphs_memory_is_a_copy(variant, pos):
    from raytrm.train.compile import Compiled

    model = small_model(variant, pos).eval()
    batch = make_batch(2)
    expected, _ = model(model.initial_carry(batch), batch)
    finished = []
    finish = model._finish
    model._finish = lambda *states: finished.append(finish(*states)) or finished[-1]
    # As compile_regions leaves a graphed round whose states stay in the graphs' memory (TRM.graph_outputs_in_place).
    model._round = Compiled(model._round, model._round, "TRM._round", in_graph_memory=True)
    carry, _ = model(model.initial_carry(batch), batch)
    torch.testing.assert_close(carry.z_H, expected.z_H, rtol=0, atol=0)
    torch.testing.assert_close(carry.z_L, expected.z_L, rtol=0, atol=0)
    z_H, z_L = finished[0][:2]
    # Attention's _finish hands the round's states on as they are: the carry copies them; positions-first states
    # come out of _finish transposed into fresh memory, which the carry keeps.
    copied = variant == "attention"
    assert (carry.z_H.data_ptr() != z_H.data_ptr(), carry.z_L.data_ptr() != z_L.data_ptr()) == (copied, copied)


def test_halted_slot_restarts_and_unhalted_slot_keeps_its_example():
    model = small_model("mlp_t", "none").train()
    first, second = make_batch(2, seed=1), make_batch(2, seed=2)
    no_explore = Exploration(torch.zeros(2, dtype=torch.int32))
    with torch.no_grad():
        carry, _ = model(model.initial_carry(first), first, no_explore)
        carry = dataclasses.replace(carry, halted=torch.tensor([True, False]))
        after, _ = model(carry, second, no_explore)
        # Slot 0 starts over from the initial states with the new example; slot 1 goes on with its old one.
        fresh, _ = model(model.initial_carry(second), second, no_explore)
        going_on = dataclasses.replace(carry, halted=torch.tensor([False, False]))
        kept, _ = model(going_on, first, no_explore)
    assert after.steps.tolist() == [1, 2]
    assert torch.equal(after.inputs[0], second["inputs"][0]) and torch.equal(after.inputs[1], first["inputs"][1])
    assert torch.equal(after.labels[0], second["labels"][0]) and torch.equal(after.labels[1], first["labels"][1])
    torch.testing.assert_close(after.z_H[0], fresh.z_H[0])
    torch.testing.assert_close(after.z_H[1], kept.z_H[1])


def test_eval_runs_all_steps_unless_halt_at_eval():
    batch = make_batch(2)
    for halt_at_eval, expected in ((False, [False, False, False, True]), (True, [True])):
        model = small_model("mlp_t", "none", halt_at_eval=halt_at_eval).eval()
        with torch.no_grad():
            model.q_head.bias.fill_(5.0)  # q_halt > 0: halting is wanted from the first step
            carry, seen = model.initial_carry(batch), []
            for _ in expected:
                carry, _ = model(carry, batch)
                seen.append(bool(carry.halted.all()))
        assert seen == expected


def test_training_halts_on_q_or_at_max_and_respects_exploration():
    model = small_model("mlp_t", "none").train()
    batch = make_batch(3)
    with torch.no_grad():
        model.q_head.weight.zero_()
        model.q_head.bias.fill_(5.0)
        explore = Exploration(torch.tensor([0, 3, 2], dtype=torch.int32))
        carry, halts = model.initial_carry(batch), []
        for _ in range(3):
            carry, _ = model(carry, batch, explore)
            halts.append(carry.halted.tolist())
            carry = dataclasses.replace(carry, halted=carry.halted & False)  # keep every slot going
    assert halts == [[True, False, False], [True, False, True], [True, True, True]]
    model.q_head.bias.data.fill_(-5.0)
    with torch.no_grad():
        carry = model.initial_carry(batch)
        for step in range(4):
            carry, _ = model(carry, batch, Exploration(torch.zeros(3, dtype=torch.int32)))
            assert carry.halted.all() == (step == 3)  # halt_max_steps = 4


def test_exploration_draws_are_reproducible_and_sliceable():
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    full = Exploration.draw(64, 0.5, 16, generator=g1)
    assert torch.equal(full.min_halt_steps, Exploration.draw(64, 0.5, 16, generator=g2).min_halt_steps)
    values = set(full.min_halt_steps.tolist())
    assert 0 in values and values - {0} and all(2 <= v <= 16 for v in values - {0})
    assert torch.equal(full[8:16].min_halt_steps, full.min_halt_steps[8:16])
    assert not Exploration.draw(8, 0.0, 16).min_halt_steps.any()
    assert not Exploration.draw(8, 1.0, 1).min_halt_steps.any()


def test_micro_batches_add_up_to_the_global_batch():
    batch = make_batch(8)
    explore = Exploration.draw(8, 0.5, 4, generator=torch.Generator().manual_seed(0))
    results = []
    for parts in (1, 4):
        model = small_model("attention", "rope").train()
        full_carry = model.initial_carry(batch)
        size = 8 // parts
        carries = []
        for i in range(parts):
            part = slice(i * size, (i + 1) * size)
            carry, out = model(full_carry[part], {k: v[part] for k, v in batch.items()}, explore[part])
            loss, _ = act_loss(out, carry, global_batch_size=8)
            loss.backward()
            carries.append(carry)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        ids, rows = model.puzzle_emb.sparse_grad()
        results.append((Carry.cat(carries), grads, ids, rows))
    (c1, g1, i1, r1), (c4, g4, i4, r4) = results
    for key, value in c1.to_dict().items():
        torch.testing.assert_close(c4.to_dict()[key], value, rtol=1e-5, atol=1e-5)
    for name in g1:
        torch.testing.assert_close(g4[name], g1[name], rtol=1e-4, atol=1e-7)
    assert torch.equal(i1, i4)
    torch.testing.assert_close(r4, r1, rtol=1e-4, atol=1e-7)


def test_a_slice_of_every_row_is_the_tensor_itself_and_others_are_rows():
    t = torch.arange(6).view(3, 2)
    assert rows(t, slice(0, 3)) is t and rows(t, slice(None)) is t
    assert rows(t, slice(1, 3)).tolist() == [[2, 3], [4, 5]]
    assert rows(t, torch.tensor([2, 0])).tolist() == [[4, 5], [0, 1]]
    carry = Carry(*(torch.zeros(3, 2) for _ in range(7)))
    assert carry[slice(0, 3)].z_H is carry.z_H and carry[slice(0, 2)].z_H.shape == (2, 2)


def test_carry_round_trips_through_a_dict():
    model = small_model("mlp_t", "none")
    batch = make_batch(4)
    carry, _ = model(model.initial_carry(batch), batch)
    again = Carry.from_dict({k: v.clone() for k, v in carry.to_dict().items()})
    assert all(torch.equal(a, b) for a, b in zip(again.to_dict().values(), carry.to_dict().values(), strict=True))
    assert Carry.cat([carry[:1], carry[1:]]).to_dict().keys() == carry.to_dict().keys()


@pytest.mark.parametrize(("variant", "pos"), [("mlp_t", "none"), ("attention", "rope")])
def test_backward_at_the_reference_configuration(variant, pos):
    torch.manual_seed(0)
    model = TRM(ModelConfig(variant=variant, pos_encodings=pos), **SUDOKU).train()
    batch = {
        "inputs": torch.randint(0, 11, (2, 81)),
        "labels": torch.randint(1, 11, (2, 81)),
        "puzzle_identifiers": torch.zeros(2, dtype=torch.long),
    }
    carry, out = model(model.initial_carry(batch), batch)
    assert out["logits"].shape == (2, 81, 11) and out["q_halt_logits"].shape == (2,)
    loss, metrics = act_loss(out, carry, global_batch_size=2)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert set(metrics) == {"count", "accuracy", "exact_accuracy", "q_halt_accuracy", "steps", "lm_loss", "q_halt_loss"}


def test_bfloat16_forward_keeps_fp32_weights():
    torch.manual_seed(0)
    config = ModelConfig(**SMALL)
    model = TRM(config, vocab_size=11, seq_len=9, num_puzzle_identifiers=3, dtype=torch.bfloat16).train()
    batch = make_batch(2)
    carry, out = model(model.initial_carry(batch), batch)
    assert carry.z_H.dtype == torch.bfloat16 and out["logits"].dtype == torch.bfloat16
    assert out["q_halt_logits"].dtype == torch.float32
    act_loss(out, carry, global_batch_size=2)[0].backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
