"""The exactness check of data-parallel training: N workers with any shares and cuts give one process's update.

`train_steps` is one worker's side (run it under `launch.spawn` or a Ray Train worker): it trains a few steps with a
share schedule and a micro-batch, and records each step's summed gradient. `compare` measures the worst difference
against the same steps in one process. The tests and the GPU check below share these.

    python -m tests.support.equivalence --device cuda --workers 2    # NCCL on a machine with two GPUs
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from raytrm import config as cfg
from raytrm.sync.process_group import ProcessGroupSync
from raytrm.train.trainer import Trainer


def _dense_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().float().cpu().clone() for name, p in trainer.model.named_parameters()}


def _final_state(trainer: Trainer) -> dict[str, Any]:
    state = trainer.state_dict()  # a collective: the carry of every slot
    return {
        "model": {k: v.detach().float().cpu() for k, v in state["model"].items()},
        "ema": {k: v.float().cpu() for k, v in state["ema"]["shadow"].items()} if state["ema"] else {},
        "carry": {k: v.cpu() for k, v in state["carry"].items()} if state["carry"] else {},
    }


def record_steps(
    trainer: Trainer,
    schedule: Sequence[Sequence[int]] | None,
    steps: int,
    on_out_of_memory: Callable[[int], int] | None = None,
) -> dict[str, Any]:
    """Train `steps` steps (switching shares per `schedule`), recording loss, metrics and gradients of each, and the
    fraction of the gradient summed during the backward (the transformer's overlapped all-reduce)."""
    out: dict[str, Any] = {"losses": [], "metrics": [], "grads": [], "overlap": []}
    for k in range(steps):
        if schedule is not None and list(schedule[k]) != trainer.shares:
            trainer.set_shares(schedule[k])
        loss, metrics = trainer.forward_backward(on_out_of_memory=on_out_of_memory)
        out["losses"].append(loss)
        out["metrics"].append(metrics)
        out["grads"].append(_dense_grads(trainer))
        out["overlap"].append(trainer.last_overlap)
        trainer.optimizer_step()
    out["state"] = _final_state(trainer)
    return out


def train_steps(
    rank: int,
    world_size: int,
    device: torch.device,
    config: cfg.ExperimentConfig,
    schedule: Sequence[Sequence[int]],
    micro_batches: Sequence[int],
    steps: int,
    bucket_mb: float = 4.0,
) -> dict[str, Any] | None:
    """One worker of a distributed run (torch.distributed already joined); rank 0 returns what it recorded."""
    trainer = Trainer(config, sync=ProcessGroupSync(device, bucket_mb=bucket_mb), shares=schedule[0])
    trainer.set_micro_batch(micro_batches[rank])
    recorded = record_steps(trainer, schedule, steps)
    return recorded if rank == 0 else None


def train_alone(config: cfg.ExperimentConfig, steps: int, micro_batch: int | None = None) -> dict[str, Any]:
    """The same steps in one process."""
    trainer = Trainer(config)
    if micro_batch:
        trainer.set_micro_batch(micro_batch)
    return record_steps(trainer, None, steps)


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| of any tensor, relative to that tensor's largest |a| entry."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = 0.0
    for key in a:
        x, y = a[key].double(), b[key].double()
        scale = float(x.abs().max()) or 1.0
        worst = max(worst, float((x - y).abs().max()) / scale)
    return worst


def compare(alone: dict[str, Any], spread: dict[str, Any]) -> dict[str, float]:
    """Worst relative differences: per-step gradients and losses, final weights, EMA and carry states."""
    carry_a, carry_b = alone["state"]["carry"], spread["state"]["carry"]
    exact_slots = all(torch.equal(carry_a[k], carry_b[k]) for k in carry_a if not carry_a[k].is_floating_point())
    losses = [abs(x - y) / max(1e-12, abs(x)) for x, y in zip(alone["losses"], spread["losses"], strict=True)]
    return {
        "grad": max(_worst(a, b) for a, b in zip(alone["grads"], spread["grads"], strict=True)),
        "loss": max(losses),
        "weights": _worst(alone["state"]["model"], spread["state"]["model"]),
        "ema": _worst(alone["state"]["ema"], spread["state"]["ema"]) if alone["state"]["ema"] else 0.0,
        "carry": _worst(
            {k: v for k, v in carry_a.items() if v.is_floating_point()},
            {k: v for k, v in carry_b.items() if v.is_floating_point()},
        )
        if carry_a
        else 0.0,
        "carry_slots_equal": float(exact_slots),
    }


def _experiment(model: str, device: str, work: Path) -> cfg.ExperimentConfig:
    """A small TRM on generated Sudoku, or a small byte-level LM on generated text, in fp32 on device."""
    from raytrm.data.build import build_dataset

    training = {"global_batch_size": 48, "lr": 3e-3, "warmup_steps": 2, "device": device, "dtype": "float32"}
    if model == "lm":
        work.mkdir(parents=True, exist_ok=True)
        text = work / "words.txt"
        words = ["red", "cat", "sat", "on", "the", "mat", "and", "ran", "far", "away"]
        text.write_text("".join(" ".join(words[(i * 7 + j) % 10] for j in range(6)) + ".\n" for i in range(800)))
        return cfg.from_dict(
            cfg.ExperimentConfig,
            {
                "model": {"name": "transformer", "hidden_size": 64, "num_heads": 4, "layers": 2, "seq_len": 32},
                "data": {"name": "text", "path": str(text)},
                "training": {**training, "seed": 5, "grad_clip": 1.0},
            },
        )
    data = build_dataset("sudoku", work / "sudoku", count=256, test_count=16, givens=40, seed=7, overwrite=True)
    return cfg.from_dict(
        cfg.ExperimentConfig,
        {
            "model": {
                "hidden_size": 64,
                "L_layers": 1,
                "H_cycles": 2,
                "L_cycles": 2,
                "halt_max_steps": 3,
                "halt_exploration_prob": 0.5,
                "forward_dtype": "float32",
            },
            "data": {"path": str(data)},
            "training": {**training, "puzzle_emb_lr": 1e-2, "seed": 3},
        },
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Check the sync on this machine's devices: uneven shares that move mid-run, against one process."""
    from raytrm.distributed.launch import spawn
    from raytrm.sync.shares import split

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--model", choices=("trm", "lm"), default="trm", help="a tiny TRM, or a byte-level LM")
    parser.add_argument(
        "--bucket-mb", type=float, default=4.0, help="gradient bucket size (small: the LM's sum starts mid-backward)"
    )
    parser.add_argument("--work", default="/tmp/raytrm-equivalence", help="where the generated data goes")
    args = parser.parse_args(argv)
    config = _experiment(args.model, args.device, Path(args.work))
    uneven = split(48, list(range(1, args.workers + 1)))
    schedule = [uneven] * (args.steps // 2) + [list(reversed(uneven))] * (args.steps - args.steps // 2)
    alone = train_alone(config, args.steps)
    spread = spawn(
        train_steps, args.workers, config, schedule, [5] * args.workers, args.steps, args.bucket_mb, device=args.device
    )[0]
    result = compare(alone, spread)
    # The noise floor: one process cutting the same batches into other micro-batches (summation order alone).
    recut = compare(alone, train_alone(config, args.steps, micro_batch=5))
    print(
        json.dumps(
            {
                "device": args.device,
                "model": args.model,
                "workers": args.workers,
                "schedule": schedule,
                "spread": result,
                "overlapped_fraction": spread["overlap"],
                "one_process_recut": recut,
            }
        )
    )
    exact = result["grad"] <= max(1e-5, 2 * recut["grad"]) and result["carry_slots_equal"]
    print(
        f"{'PASS' if exact else 'FAIL'}: {args.model} on {args.workers} workers vs one process, worst gradient "
        f"difference {result['grad']:.2e} of each tensor's largest entry (one process re-cut: {recut['grad']:.2e})"
    )
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
