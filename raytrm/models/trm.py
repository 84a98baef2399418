"""TRM, the Tiny Recursive Model ("Less is More: Recursive Reasoning with Tiny Networks"), with ACT halting.

One small network refines two states: z_L (the latent, "z") from the answer and the input, and z_H (the answer,
"y") from the latent. A supervision step runs H_cycles rounds of L_cycles latent updates and one answer update;
only the last round is back-propagated. The states persist across supervision steps in a Carry, one slot per
batch row, until the slot halts (ACT) and takes a new example.

Faithful to the reference SamsungSAILMontreal/TinyRecursiveModels (models/recursive_reasoning/trm.py): same
equations, inits and parameter counts. Single-device: whoever calls it picks the device and the forward dtype.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from raytrm.config import ModelConfig
from raytrm.hardware import device as devices
from raytrm.models.layers import Attention, Embedding, Linear, RotaryEmbedding, SparseEmbedding, SwiGLU, trunc_normal_
from raytrm.models.ops import add_rms_norm, cast

logger = logging.getLogger(__name__)

Rope = tuple[torch.Tensor, torch.Tensor] | None  # (cos, sin) tables, or None without RoPE


def rows(t: torch.Tensor, index: slice | torch.Tensor) -> torch.Tensor:
    """t's rows at index: t itself where index is a slice of all of them. A step takes all slots of its batch and
    carry unless it is cut into micro-batches or shared between workers, and a slice, a view though it is, costs an
    operator call of the host at the step's start, while the device waits for its first kernels."""
    if isinstance(index, slice) and index.indices(len(t)) == (0, len(t), 1):
        return t
    return t[index]


@dataclass
class Carry:
    """What TRM keeps between supervision steps, one slot per batch row."""

    z_H: torch.Tensor  # [B, L, D] answer state, in the forward dtype
    z_L: torch.Tensor  # [B, L, D] latent state
    steps: torch.Tensor  # [B] int32 supervision steps the slot's example has had
    halted: torch.Tensor  # [B] bool; a halted slot takes the next incoming example
    inputs: torch.Tensor  # [B, seq_len] the slot's current example
    labels: torch.Tensor  # [B, seq_len]
    puzzle_identifiers: torch.Tensor  # [B]

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, state: dict[str, torch.Tensor]) -> Carry:
        return cls(**{f.name: state[f.name] for f in dataclasses.fields(cls)})

    def __getitem__(self, index: slice | torch.Tensor) -> Carry:
        """The carry of some slots (a micro-batch's share of a global carry)."""
        return Carry(**{k: rows(v, index) for k, v in self.to_dict().items()})

    def assign_(self, index: slice, other: Carry) -> None:
        """Write other's slots into this carry's slots at index, in place."""
        for f in dataclasses.fields(self):
            getattr(self, f.name)[index] = getattr(other, f.name)

    @classmethod
    def cat(cls, carries: Sequence[Carry]) -> Carry:
        """Slots of several carries, in order: the inverse of slicing."""
        return cls(**{f.name: torch.cat([getattr(c, f.name) for c in carries]) for f in dataclasses.fields(cls)})

    def to(self, device: torch.device | str) -> Carry:
        return Carry(**{k: v.to(device) for k, v in self.to_dict().items()})


@dataclass
class Exploration:
    """Per-slot halting exploration: a slot may not halt before min_halt_steps (0 where not exploring).

    Drawn outside the model so a trainer can draw it for the whole global batch and slice it per micro-batch.
    """

    min_halt_steps: torch.Tensor  # [B] int32

    @classmethod
    def draw(
        cls,
        batch_size: int,
        prob: float,
        halt_max_steps: int,
        generator: torch.Generator | None = None,
        device: torch.device | None = None,
    ) -> Exploration:
        """With probability prob, a slot gets a minimum drawn uniformly from 2..halt_max_steps."""
        if halt_max_steps < 2:
            return cls(torch.zeros(batch_size, dtype=torch.int32, device=device))
        where = generator.device if generator is not None else device
        explore = torch.rand(batch_size, generator=generator, device=where) < prob
        minimum = torch.randint(
            2, halt_max_steps + 1, (batch_size,), generator=generator, device=where, dtype=torch.int32
        )
        min_halt_steps = torch.where(explore, minimum, 0)
        if device is None:
            return cls(min_halt_steps)
        return cls(devices.queued_copy(min_halt_steps, device))

    def __getitem__(self, index: slice | torch.Tensor) -> Exploration:
        return Exploration(rows(self.min_halt_steps, index))


class Block(nn.Module):
    """Post-norm block: a mixer across positions (attention or mlp_t), then a SwiGLU across features.

    x is in the step's layout (see TRM.positions_first): [L, B, D] for mlp_t, [B, L, D] for attention.
    """

    def __init__(self, config: ModelConfig, positions: int) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.attn: Attention | None = None
        self.mlp_t: SwiGLU | None = None
        if config.variant == "mlp_t":
            self.mlp_t = SwiGLU(positions, config.expansion)
        else:
            self.attn = Attention(config.hidden_size, config.num_heads, causal=False)
        self.mlp = SwiGLU(config.hidden_size, config.expansion)

    def forward(self, x: torch.Tensor, rope: Rope, then: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output, plus `then` where given (added as a separate add would, in the last kernel where it
        can be)."""
        if self.mlp_t is not None:
            L, B, D = x.shape
            # The reference mixes and normalises the transposed [B, D, L] tensor, so this norm is over positions.
            x = self.mlp_t.mix_norm(x.view(L, B * D), self.eps).view(L, B, D)
        else:
            assert self.attn is not None
            x = add_rms_norm(x, self.attn(x, rope), self.eps)
        return self.mlp.add_norm(x, self.eps, then)


class TRM(nn.Module):
    """Tiny Recursive Model with ACT halting over a persistent carry.

    Weights are fp32; `dtype` is the forward dtype (states and activations), chosen by the caller.
    """

    z_H_init: torch.Tensor
    z_L_init: torch.Tensor
    #: The step's edges, which raytrm.train.compile compiles on CUDA beside the round (see compile_regions).
    EDGES = ("_start", "_finish")
    #: The region CUDA graphs record (raytrm.train.compile): the round, run H_cycles times a step. The edges run
    #: once a step, so graphing them saves one launch sequence at most.
    graph_regions = ("_round",)
    #: Graphed regions whose outputs stay in the graphs' memory (raytrm.train.compile): each round hands its states to
    #: the next where it wrote them, and `forward` copies out the carry's. Copied out after every round, the states
    #: were copied back in by the next round's replay: 5 of TRM-attention's [B, L, D] tensors a round.
    graph_outputs_in_place = ("_round",)

    def __init__(
        self,
        config: ModelConfig,
        vocab_size: int,
        seq_len: int,
        num_puzzle_identifiers: int = 1,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.seq_len = seq_len
        self.puzzle_emb_len = config.puzzle_emb_len
        # The layout of the states inside a step. TRM-MLP's position mixing is a plain matrix product on positions-
        # first [L, B, D] states, viewed as [L, B * D]; attention keeps the carry's batch-first [B, L, D], which needs
        # no transposes in and out and gives SDPA heads in its usual strides (a faster eager step on a GPU).
        self.positions_first = config.variant == "mlp_t"
        positions = seq_len + self.puzzle_emb_len
        hidden = config.hidden_size
        self.embed_scale = math.sqrt(hidden)

        self.embed_tokens = Embedding(vocab_size, hidden, init_std=1.0 / self.embed_scale)
        self.lm_head = Linear(hidden, vocab_size)
        # Two outputs (halt, continue) as in the reference; only halt is used, continue keeps the counts equal.
        self.q_head = Linear(hidden, 2, bias=True)
        # The reference's puzzle vector has puzzle_emb_ndim = hidden_size entries: it fills prefix position 0.
        self.puzzle_emb = SparseEmbedding(num_puzzle_identifiers, hidden) if self.puzzle_emb_len else None
        self.rotary: RotaryEmbedding | None = None
        self.embed_pos: Embedding | None = None
        if config.pos_encodings == "rope":
            self.rotary = RotaryEmbedding(hidden // config.num_heads, positions, config.rope_theta)
        elif config.pos_encodings == "learned":
            self.embed_pos = Embedding(positions, hidden, init_std=1.0 / self.embed_scale)
        self.blocks = nn.ModuleList(Block(config, positions) for _ in range(config.L_layers))
        self.register_buffer("z_H_init", trunc_normal_(torch.empty(hidden), std=1.0))
        self.register_buffer("z_L_init", trunc_normal_(torch.empty(hidden), std=1.0))
        with torch.no_grad():
            # Q starts near "never halt" so halting is learned only once answers become right.
            self.q_head.weight.zero_()
            assert self.q_head.bias is not None
            self.q_head.bias.fill_(-5.0)
        logger.debug("TRM %s: %d parameters, forward dtype %s", config.variant, self.num_parameters(), dtype)

    @property
    def compile_regions(self) -> tuple[str, ...]:
        """One round, and on CUDA also the step's start (the carry's reset, the embeddings) and finish (the heads),
        whose element-wise passes over [B, L, D] inductor fuses (eager, they cost a GPU step a visible share). CPU
        steps keep them eager."""
        return ("_round", *self.EDGES) if self.z_H_init.device.type == devices.CUDA else ("_round",)

    @property
    def batch_dims(self) -> dict[str, tuple[int | None, ...]]:
        """Where each region's positional arguments hold the micro-batch (None: nowhere), for
        raytrm.train.compile: the carry's layout is batch-first, the step's states are positions-first for mlp_t."""
        step = 1 if self.positions_first else 0
        return {"_round": (step, step, step, None), "_start": (0,) * 9, "_finish": (step, step)}

    def num_parameters(self) -> int:
        """Parameters as the reference counts them: the puzzle-embedding table is a buffer, so it is excluded."""
        return sum(p.numel() for p in self.parameters())

    # -- one supervision step ------------------------------------------------------------------------------------

    def _embed(self, inputs: torch.Tensor, puzzle: torch.Tensor | None) -> torch.Tensor:
        """Input embeddings in the step's layout: [L, B, D] positions-first, else [B, L, D]; puzzle: the puzzle
        embedding's rows [B, D] (fp32), where the model has one."""
        seq = 0 if self.positions_first else 1  # the positions' dimension
        x = self.embed_tokens(inputs.t() if self.positions_first else inputs, self.dtype)
        if puzzle is not None:
            puzzle = cast(puzzle, self.dtype).unsqueeze(seq)
            padding_shape = list(x.shape)
            padding_shape[seq] = self.puzzle_emb_len - 1
            x = torch.cat((puzzle, x.new_zeros(padding_shape), x), dim=seq)
        if self.embed_pos is not None:
            # Scaled by 1/sqrt(2) to keep the forward variance of the sum.
            x = 0.707106781 * (x + cast(self.embed_pos.weight, self.dtype).unsqueeze(1 - seq))
        return self.embed_scale * x

    def _net(self, h: torch.Tensor, rope: Rope, then: torch.Tensor | None = None) -> torch.Tensor:
        """The one network of TRM, the blocks, on its input h (a state plus its injection); plus `then` where given."""
        for i, block in enumerate(self.blocks):
            h = block(h, rope, then if i == len(self.blocks) - 1 else None)
        return h

    def _recurse(self, z_H: torch.Tensor, z_L: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rope = self.rotary() if self.rotary is not None else None
        # All rounds but the last refine the states without a graph: deep supervision back-propagates one round.
        with torch.no_grad():
            for _ in range(self.config.H_cycles - 1):
                z_H, z_L = self._round(z_H, z_L, x, rope)
        return self._round(z_H, z_L, x, rope)

    def _round(
        self, z_H: torch.Tensor, z_L: torch.Tensor, x: torch.Tensor, rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """L_cycles latent updates from the answer and the input, then one answer update from the latent.

        Each update's network takes its state plus the injection: z_L + (z_H + x) for the latent, z_H + z_L for the
        answer. z_H is fixed during the latent updates, so z_H + x is formed once, and every latent update but the
        last adds it to its own output for the next (the `then` of SwiGLU.add_norm, which a fast path may add in the
        down projection's epilogue; the same bits as adding after it).
        """
        inject = z_H + x
        h = z_L + inject
        for _ in range(self.config.L_cycles - 1):
            h = self._net(h, rope, then=inject)
        z_L = self._net(h, rope)
        return self._net(z_H + z_L, rope), z_L

    def _start(
        self, halted: torch.Tensor, z_H: torch.Tensor, z_L: torch.Tensor, steps: torch.Tensor, inputs: torch.Tensor,
        labels: torch.Tensor, new_inputs: torch.Tensor, new_labels: torch.Tensor, puzzle: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """The step's states, in its layout, and its input embeddings, steps, inputs and labels: halted slots restart
        from the initial states with the new example (new_inputs, new_labels, puzzle: its puzzle rows), the others
        go on with the carry's (z_H, z_L [B, L, D], steps, inputs, labels)."""
        # TRM-MLP's step runs on positions-first states (see positions_first): the carry's are transposed on the
        # way in and out. Every matrix product then acts on a contiguous view.
        if self.positions_first:
            reset = halted.view(1, -1, 1)
            z_H = torch.where(reset, cast(self.z_H_init, self.dtype), z_H.transpose(0, 1)).contiguous()
            z_L = torch.where(reset, cast(self.z_L_init, self.dtype), z_L.transpose(0, 1)).contiguous()
        else:
            reset = halted.view(-1, 1, 1)
            z_H = torch.where(reset, cast(self.z_H_init, self.dtype), z_H)
            z_L = torch.where(reset, cast(self.z_L_init, self.dtype), z_L)
        steps = torch.where(halted, 0, steps)
        inputs = torch.where(halted.view(-1, 1), new_inputs, inputs)
        labels = torch.where(halted.view(-1, 1), new_labels, labels)
        return z_H, z_L, self._embed(inputs, puzzle), steps, inputs, labels

    def _finish(self, z_H: torch.Tensor, z_L: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The states in the carry's layout [B, L, D], the logits [B, seq_len, vocab] and the halting head's two
        logits [B] (fp32)."""
        if self.positions_first:
            z_H = z_H.transpose(0, 1).contiguous()
            z_L = z_L.transpose(0, 1).contiguous()
        # Over every position and then sliced, as the reference does: the states go in as they are, where the
        # puzzle positions left out would cost a copy of the rest, and their gradient a zero-filled copy back.
        logits = self.lm_head(z_H)[:, self.puzzle_emb_len :]
        q_halt, q_continue = cast(self.q_head(z_H[:, 0]), torch.float32).unbind(-1)
        return z_H, z_L, logits, q_halt, q_continue

    # -- ACT over the carry --------------------------------------------------------------------------------------

    def initial_carry(self, batch: dict[str, torch.Tensor]) -> Carry:
        """A carry with every slot halted, so the first step fills all slots from its batch."""
        inputs = batch["inputs"]
        B = inputs.shape[0]
        shape = (B, self.seq_len + self.puzzle_emb_len, self.config.hidden_size)
        return Carry(
            z_H=torch.zeros(shape, dtype=self.dtype, device=inputs.device),
            z_L=torch.zeros(shape, dtype=self.dtype, device=inputs.device),
            steps=torch.zeros(B, dtype=torch.int32, device=inputs.device),
            halted=torch.ones(B, dtype=torch.bool, device=inputs.device),
            inputs=torch.zeros_like(inputs),
            labels=torch.zeros_like(batch["labels"]),
            puzzle_identifiers=torch.zeros_like(batch["puzzle_identifiers"]),
        )

    def forward(
        self,
        carry: Carry,
        batch: dict[str, torch.Tensor],
        exploration: Exploration | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Carry, dict[str, torch.Tensor]]:
        """One supervision step for every slot.

        Halted slots restart from the initial states with the batch's row at their index; rows landing on
        unhalted slots are dropped. Returns the new carry (detached) and {"logits" [B, seq_len, vocab],
        "q_halt_logits" [B] fp32, "q_continue_logits" [B] fp32}; the labels to score are `carry.labels`.
        In training, `exploration` is drawn from `generator` (or the default RNG) when not given.
        """
        halted = carry.halted
        puzzle_identifiers = torch.where(halted, batch["puzzle_identifiers"], carry.puzzle_identifiers)
        # The puzzle embedding's rows are a leaf of their own for the sparse optimizer, so they are gathered here,
        # outside the compiled start.
        puzzle = self.puzzle_emb(puzzle_identifiers) if self.puzzle_emb is not None else None
        z_H, z_L, x, steps, inputs, labels = self._start(
            halted, carry.z_H, carry.z_L, carry.steps, carry.inputs, carry.labels, batch["inputs"], batch["labels"],
            puzzle,
        )  # fmt: skip
        z_H, z_L = self._recurse(z_H, z_L, x)
        z_H, z_L, logits, q_halt, q_continue = self._finish(z_H, z_L)
        if getattr(self._round, "in_graph_memory", False) and not self.positions_first:
            # _finish handed on the last round's states, in CUDA graphs' memory, which the next step's replays
            # rewrite: the carry keeps copies (positions-first states are transposed into fresh ones).
            z_H, z_L = z_H.detach().clone(), z_L.detach().clone()

        with torch.no_grad():
            steps = steps + 1
            max_steps = self.config.halt_max_steps
            halted = steps >= max_steps
            if self.training and max_steps > 1:
                halted = halted | (q_halt > 0)
                if exploration is None:
                    exploration = Exploration.draw(
                        steps.shape[0], self.config.halt_exploration_prob, max_steps, generator, steps.device
                    )
                halted = halted & (steps >= exploration.min_halt_steps.to(steps.device))
            elif not self.training and self.config.halt_at_eval:
                halted = halted | (q_halt > 0)

        new_carry = Carry(z_H.detach(), z_L.detach(), steps, halted, inputs, labels, puzzle_identifiers)
        return new_carry, {"logits": logits, "q_halt_logits": q_halt, "q_continue_logits": q_continue}
