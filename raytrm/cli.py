"""The `raytrm` command: one subcommand per step of the flow."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from raytrm import __version__
from raytrm.constants import DEFAULT_LOG_LEVEL, LOG_LEVEL_ENV
from raytrm.errors import UserError

logger = logging.getLogger("raytrm")


def cmd_probe(args: argparse.Namespace) -> int:
    from raytrm.hardware.probe import detect, format_table, probe_document
    from raytrm.hardware.tiers import load_tiers, match_tier

    hw = detect()
    tier = match_tier(hw, load_tiers(args.tiers))
    if args.json:
        print(json.dumps(probe_document(hw, tier), indent=2))
    else:
        print(format_table(hw, tier))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from raytrm import config
    from raytrm.constants import named_file
    from raytrm.hardware.tiers import load_tiers

    args.file = str(named_file(args.file) or args.file)  # `raytrm validate quick`: the packaged space
    data = config.read_yaml(args.file)
    if isinstance(data, dict) and "raytrm_tiers" in data:
        print(f"{args.file}: valid tier table, {len(load_tiers(args.file))} tiers")
        return 0
    if isinstance(data, dict) and "raytrm_space" in data:
        from raytrm.tune.space import load_space

        space = load_space(args.file, _space_base(args))
        print(f"# {args.file}: valid search space, {len(space.parsed)} parameters; as tuned:")
        print(config.dump_yaml(space.to_dict()), end="")
        return 0
    if isinstance(data, dict) and "raytrm_profile" in data:
        obj: object = config.load_profile(args.file)
        kind = "profile"
    else:
        obj = config.from_dict(config.ExperimentConfig, data, args.file)
        kind = "training config"
    print(f"# {args.file}: valid {kind}; resolved with defaults:")
    print(config.dump_yaml(obj), end="")
    return 0


# Flags for the common fields of a training config: flag -> (section, field, type, help).
TRAIN_FLAGS = {
    "--steps": ("training", "steps", int, "optimizer steps to run"),
    "--time-budget": ("training", "time_budget_s", float, "wall-clock budget in seconds"),
    "--global-batch": ("training", "global_batch_size", int, "samples per optimizer step"),
    "--micro-batch": ("training", "micro_batch_size", int, "samples per forward/backward"),
    "--grad-accum": ("training", "grad_accum_steps", int, "micro-batches per optimizer step"),
    "--lr": ("training", "lr", float, "peak learning rate"),
    "--threads": ("training", "threads", int, "torch intra-op threads"),
    "--memory-budget-mb": ("training", "memory_budget_mb", int, "memory budget in MiB (default: the tier's)"),
    "--thermal-cap": ("training", "thermal_cap", str, "nominal, fair or serious (default: the tier's)"),
    "--device": ("training", "device", str, "auto, cpu, cuda or mps"),
    "--dtype": ("training", "dtype", str, "auto, float32, bfloat16 or float16"),
    "--seed": ("training", "seed", int, "seed of weights, data order and exploration"),
    "--eval-interval": ("training", "eval_interval", int, "steps between evaluations"),
    "--log-interval": ("training", "log_interval", int, "steps between metrics lines"),
    "--checkpoint-interval": ("training", "checkpoint_interval", int, "steps between checkpoints"),
    "--sync-mode": (
        "training",
        "sync_mode",
        str,
        "several workers: auto (from the measured link), exact, compressed (bf16) or local (rounds)",
    ),
    "--sync-every": ("training", "sync_every", int, "local rounds: inner steps per round (default: from the link)"),
    "--model": (
        "model",
        "name",
        str,
        "model family: trm, transformer or hf (your own Hugging Face model; default trm)",
    ),
    "--model-path": ("model", "path", str, "hf: a transformers model, a local directory (or a hub name)"),
    "--lora-rank": (
        "model",
        "lora_rank",
        int,
        "hf: LoRA of this rank: only the adapters and a classifier's head train",
    ),
    "--task": (
        "model",
        "task",
        str,
        "transformer, hf: lm (next byte or token) or classify (documents); hf: from the records' label column if unset",
    ),
    "--seq-len": ("model", "seq_len", int, "transformer: bytes per training sequence"),
    "--layers": ("model", "layers", int, "transformer blocks"),
    "--variant": ("model", "variant", str, "TRM variant: mlp_t or attention"),
    "--hidden-size": ("model", "hidden_size", int, "model width"),
    "--H-cycles": ("model", "H_cycles", int, "outer recursion rounds"),
    "--L-cycles": ("model", "L_cycles", int, "latent updates per round"),
    "--L-layers": ("model", "L_layers", int, "blocks in the network"),
    "--dataset": ("data", "name", str, "generated dataset: sudoku or maze"),
    "--data": (
        "data",
        "path",
        str,
        "TRM: dataset directory in the reference layout; transformer: a text file, a directory of text files, "
        "or JSONL/CSV records (default: the Python standard library's sources)",
    ),
    "--text-field": ("data", "text_field", str, "transformer: JSONL field or CSV column of the text"),
    "--label-field": ("data", "label_field", str, "classify: JSONL field or CSV/Parquet column of the label"),
    "--text-fields": ("data", "text_fields", list, "hf records: the fields whose texts make a record's (subject body)"),
    "--validation": ("data", "validation_path", str, "hf records: held-out records (default: a share of --data)"),
    "--givens": ("data", "givens", int, "Sudoku clues per puzzle (fewer is harder)"),
    "--train-puzzles": ("data", "train_puzzles", int, "puzzles generated for training"),
}


#: The flags of `raytrm tune` and `raytrm validate` that set a space's base experiment: the user's own model and
#: records in a shipped space (hf-classify, hf-lm).
SPACE_BASE_FLAGS = ("--model-path", "--data", "--validation", "--text-fields", "--label-field", "--lora-rank")
#: Fields that name files: a space's trials may run in another working directory, so these are made absolute.
PATH_FIELDS = (("model", "path"), ("data", "path"), ("data", "validation_path"))


def _flag_dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _add_flags(p: Any, flags: Iterable[str]) -> None:
    """Add TRAIN_FLAGS' `flags` to a parser or an argument group of one."""
    for flag in flags:
        kind, text = TRAIN_FLAGS[flag][2:]
        many = {"nargs": "+", "type": str} if kind is list else {"type": kind}
        p.add_argument(flag, dest=_flag_dest(flag), default=None, help=text, **many)


def _overrides(args: argparse.Namespace, flags: Iterable[str] = TRAIN_FLAGS) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for flag in flags:
        section, name = TRAIN_FLAGS[flag][:2]
        value = getattr(args, _flag_dest(flag))
        if value is not None:
            out.setdefault(section, {})[name] = value
    return out


def _space_base(args: argparse.Namespace) -> dict[str, dict[str, object]]:
    """The space's base fields given as flags, their paths absolute (a local model directory; a hub name stays)."""
    base = _overrides(args, SPACE_BASE_FLAGS)
    for section, name in PATH_FIELDS:
        value = base.get(section, {}).get(name)
        if isinstance(value, str) and (section == "data" or Path(value).expanduser().exists()):
            base[section][name] = str(Path(value).expanduser().resolve())
    return base


def cmd_train(args: argparse.Namespace) -> int:
    from raytrm.train.run.directory import claim_run_dir
    from raytrm.train.run.experiment import resolve_experiment
    from raytrm.train.run.training import run_training

    profiles = args.profile or []
    distributed = args.workers is not None or args.address is not None
    if args.elastic and not distributed:
        raise UserError("--elastic needs several workers: give --workers N or --address")
    if args.quiet:  # a distributed run also routes Ray's and the workers' lines to its logs (distributed.run_logs)
        _warnings_only()
    if len(profiles) > 1 and not distributed:
        raise UserError("several --profile (one per tier) need --workers N or --address; give one to train alone")
    overrides = _overrides(args)
    experiment, run_dir = resolve_experiment(
        config_file=args.config,
        profile_file=profiles[0] if profiles else None,
        out=args.out,
        resume=args.resume,
        overrides=overrides,
        tier_defaults=not distributed,
        overwrite=args.overwrite,
    )
    claim_run_dir(run_dir, resume=args.resume, overwrite=args.overwrite)
    if distributed:
        from raytrm import config
        from raytrm.distributed.ray_train import train_distributed

        summary = train_distributed(
            experiment,
            run_dir,
            workers=args.workers,
            address=args.address,
            profiles=[config.load_profile(p) for p in profiles],
            profile_names=profiles,
            explicit=sorted(overrides.get("training", {})),
            resume=args.resume,
            progress=not args.quiet,
            balance=not args.equal_shares,
            elastic=args.elastic,
        )
    else:
        summary = run_training(experiment, run_dir, resume=args.resume, progress=not args.quiet)
    print(format_summary(summary, run_dir))
    return 130 if str(summary.get("stop_reason") or "").startswith("interrupted") else 0


def _warnings_only() -> None:
    """--quiet on one machine: the terminal shows raytrm's warnings and the summary, not its INFO lines."""
    for handler in logging.getLogger().handlers:
        handler.setLevel(max(handler.level, logging.WARNING))


def format_summary(summary: dict, run_dir: object) -> str:
    """The end-of-run lines a person reads."""
    tokens = f"{summary['tokens_per_sec']:.0f} tokens/s, " if "tokens_per_sec" in summary else ""
    if "eval_bits_per_byte" in summary:
        scores = (
            f"eval on {summary['eval_bytes']:.0f} held-out bytes: {summary['eval_bits_per_byte']:.3f} bits per byte "
            f"(the training bytes' unigram frequencies score {summary['eval_unigram_bits_per_byte']:.3f})"
        )
    elif "eval_perplexity" in summary:
        scores = (
            f"eval on {summary['eval_tokens']:.0f} held-out tokens: loss {summary['eval_loss']:.3f}, perplexity "
            f"{summary['eval_perplexity']:.2f}"
        )
    elif "eval_macro_f1" in summary:
        scores = (
            f"eval on {summary['eval_documents']:.0f} held-out documents: accuracy {summary['eval_accuracy']:.3f} "
            f"(always the majority class scores {summary['eval_majority_acc']:.3f}), "
            f"macro-F1 {summary['eval_macro_f1']:.3f}"
        )
    else:
        scores = (
            f"eval on {summary['eval_puzzles']:.0f} puzzles: cell accuracy {summary['eval_cell_acc']:.3f} "
            f"(copying the givens scores {summary['eval_copy_givens_acc']:.3f}), "
            f"exact {summary['eval_exact_acc']:.3f}, {summary['eval_steps']:.1f} supervision steps"
        )
    workers = (
        f" on {summary['workers']} workers (shares {summary['shares']}, {len(summary['rebalances'])} rebalances)"
        if summary.get("workers")
        else ""
    )
    stopped = f", stopped: {summary['stop_reason']}" if summary.get("stop_reason") else ""
    lines = [
        f"trained {summary['steps']} steps{workers} in {summary['train_seconds']:.1f} s{stopped}",
        f"{_rates(summary, tokens)}; {summary['device']} {summary['dtype']}, "
        f"peak memory {summary['peak_rss_mb']:.0f} MiB",
        scores,
        f"run directory {run_dir}: metrics.jsonl, summary.json, checkpoint {summary['checkpoint']}",
    ]
    return "\n".join(lines)


def _rates(summary: dict, tokens: str) -> str:
    """The warm-up (setup and first steps) apart from the steady rate (a summary of an older run has one rate)."""
    overall = f"{summary['samples_per_sec']:.1f} samples/s, {tokens}".rstrip(", ")
    if "warmup_seconds" not in summary:
        return overall
    warmup = (
        f"warm-up {summary['setup_seconds'] + summary['warmup_seconds']:.1f} s (setup {summary['setup_seconds']:.1f} "
        f"s and the first {summary['warmup_steps']} step(s))"
    )
    steady = summary.get("steady_samples_per_sec")
    if not steady:
        return f"{warmup}, no steady step after it ({overall} over all)"
    scale = steady / summary["samples_per_sec"]
    steady_tokens = f", {summary['tokens_per_sec'] * scale:.0f} tokens/s" if tokens else ""
    return f"{warmup}, then {steady:.1f} samples/s{steady_tokens} over {summary['steady_steps']} steady step(s)"


def cmd_data(args: argparse.Namespace) -> int:
    from raytrm.data.build import build_dataset
    from raytrm.train.run.directory import guard_output

    if not Path(args.out).is_file():  # a file there is refused by the dataset's own check, which keeps it
        guard_output(args.out, directory=True)  # never into a run's checkpoints or over a run's own directory
    test_count = args.test_count if args.test_count is not None else max(1, args.count // 10)
    path = build_dataset(
        args.kind,
        args.out,
        count=args.count,
        test_count=test_count,
        givens=args.givens,
        augment=args.augment,
        size=args.size,
        seed=args.seed,
        overwrite=args.overwrite,
    )
    print(f"wrote {args.kind} dataset to {path} (train and test splits)")
    return 0


def cmd_import_checkpoint(args: argparse.Namespace) -> int:
    from raytrm.train.run.reference_checkpoints import import_reference

    path = import_reference(args.checkpoint, args.out, config_file=args.config)
    print(f"imported {args.checkpoint} into {path}; continue with `raytrm train --out {args.out} --resume`")
    return 0


def cmd_export_checkpoint(args: argparse.Namespace) -> int:
    from raytrm.train.run.reference_checkpoints import export_reference

    path = export_reference(args.run_dir, args.out, ema=not args.raw_weights)
    print(f"wrote {path} in the TRM reference layout")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from raytrm.tune.tuner import run_tune

    if args.out and args.resume:
        raise UserError("give --out for a new run or --resume RUN_DIR to continue one, not both")
    run_tune(
        args.space, trials=args.trials, out=args.out, resume=args.resume, address=args.address, base=_space_base(args)
    )
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from pathlib import Path

    from raytrm.families.hf_predict import predict
    from raytrm.train.run.directory import guard_output

    records = Path(args.records)
    out = guard_output(args.out or records.with_name(f"{records.stem}.predictions.csv"))
    print(f"wrote each record's label and score to {predict(args.run_dir, records, out)}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from raytrm.families.hf_predict import evaluate

    print(format_evaluation(evaluate(args.run_dir, args.records)))
    return 0


def format_evaluation(result: dict) -> str:
    """Accuracy, macro-F1 and the confusion matrix (rows the true labels, columns the predicted ones) as a table."""
    labels = [str(name) for name in result["labels"]]
    width = max([8, *map(len, labels)])
    lines = [
        f"{result['documents']} records: accuracy {result['accuracy']:.3f}, macro-F1 {result['macro_f1']:.3f}",
        "confusion (rows: true label, columns: predicted):",
        " " * width + " " + " ".join(f"{name:>{width}}" for name in labels),
    ]
    for name, row in zip(labels, result["confusion"], strict=True):
        lines.append(f"{name:>{width}} " + " ".join(f"{count:>{width}}" for count in row))
    return "\n".join(lines)


def cmd_export(args: argparse.Namespace) -> int:
    from raytrm.tune.profiles import export_run

    what = "Hugging Face TrainingArguments" if args.format == "hf" else "profile"
    for tier, path in export_run(args.run_dir, tier=args.tier, out=args.out, form=args.format).items():
        print(f"wrote the {what} of tier {tier} to {path}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from raytrm.report import write_report

    print(write_report(args.run_dir, out=args.out).text)
    return 0


def job_command(dashboard: str) -> str:
    """The job line the head prints: `raytrm tune` as a Ray job, which joins the cluster it is submitted to."""
    return f"RAY_AUTH_MODE=token ray job submit --address {dashboard} --working-dir . -- raytrm tune"


def port_number(text: str) -> int:
    """argparse type of a TCP port: 1-65535, else refused (a port out of range is never wrapped or left to Ray)."""
    from raytrm.distributed.node import PORT_RANGE
    from raytrm.distributed.node import port_number as parse

    port = parse(text)
    if port is None:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected a port from {PORT_RANGE[0]} to {PORT_RANGE[1]}")
    return port


def cmd_cluster(args: argparse.Namespace) -> int:
    from raytrm.distributed import cluster_commands as cluster

    if args.action == "head":
        done = cluster.head(
            args.node_ip,
            args.port,
            args.tier,
            args.token_file,
            args.dashboard_host,
            args.object_store_mb,
            args.autoscaling_config,
            args.paths_port,
        )
        ip, token = done["address"].rpartition(":")[0], done["token_file"]
        print(f"head of tier {done['tier']} at {done['address']} (memory budget {done['memory_budget_mb']} MiB)")
        print(f"path service on port {done['paths_port']}, every interface: `join` measures each path to this Mac")
        print(f"token: {token} (mode 0600{', new' if done['token_created'] else ''}); on each other Mac:")
        print(f"  scp {ip}:.ray/auth_token ~/.ray/auth_token && chmod 600 ~/.ray/auth_token")
        own_port = "" if args.paths_port is None else f" --paths-port {done['paths_port']}"
        print(f"  raytrm cluster join {done['address']}{own_port}")
        if done["advertised"]:
            print("  (or `raytrm cluster join` alone, which finds this head by mDNS where multicast reaches)")
        where = "from any Mac with the token" if done["dashboard_on_lan"] else "here"
        print(f"jobs, submitted {where}: {job_command(done['dashboard'])}")
        return cluster.block() if args.block else 0
    elif args.action == "join":
        done = cluster.join(args.head, args.node_ip, args.tier, args.token_file, args.object_store_mb, args.paths_port)
        _print_paths(done)
        print(f"joined {done['head']} as a node of tier {done['tier']} at {done['address']}")
        return cluster.block() if args.block else 0
    elif args.action == "paths":
        _print_paths(cluster.measure(args.head, args.token_file, args.paths_port), joined=False)
    elif args.action == "status":
        print(cluster.format_status(cluster.status(args.address, args.token_file, link=args.link)))
    else:
        print(cluster.stop())
    return 0


def _print_paths(done: dict, joined: bool = True) -> None:
    """The paths to the head as measured, and the one the gradient sync takes (or would take, not joined)."""
    from raytrm.distributed.paths import table

    if done.get("found"):
        print(f"found the head {done['found']} at {done['head']} by mDNS")
    print(f"paths to the head {done['head'].rpartition(':')[0]}, measured from this Mac:")
    print(table(done["paths"], done["chosen"]))
    chosen = done["chosen"]
    if done.get("path") and chosen is None:
        print(f"the gradient sync takes the path of --node-ip {done['path']}, as given")
    elif chosen is not None and joined:
        print(f"the gradient sync takes the fastest: {chosen.interface} {chosen.local}")
    elif chosen is not None:
        print(f"the fastest: {chosen.interface} {chosen.local} (`raytrm cluster join` takes it for the gradient sync)")


#: argparse's words for a value its type refused, and how raytrm says what was expected.
_TYPE_WORDS = {"int": "an integer", "float": "a number"}


class Parser(argparse.ArgumentParser):
    """argparse with raytrm's errors: one line naming the flag, the value and what is expected (for an unknown flag,
    the closest known one), raised as a UserError, so main prints `raytrm: error: ...` and exits 2. Subcommands'
    parsers are made of this class too (add_subparsers passes the parser's own class)."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:  # answered here, by the innermost parser, which knows the flags that were meant
            self.error(self._unknown(extras))
        return namespace, extras

    def _unknown(self, extras: list[str]) -> str:
        first = extras[0]
        if not first.startswith("-"):
            return f"unexpected argument {first!r}"
        flags = [flag for action in self._actions for flag in action.option_strings]
        close = difflib.get_close_matches(first.split("=", 1)[0], flags, n=1, cutoff=0.6)
        return f"unknown option {first}" + (f"; did you mean {close[0]}?" if close else "")

    def error(self, message: str) -> NoReturn:
        see = f"see `{self.prog} --help`"
        match = re.fullmatch(r"argument (\S+): invalid (\w+) value: (.*)", message)
        if match:
            flag, kind, value = match.groups()
            expected = _TYPE_WORDS.get(kind, f"a {kind}")
            text = next((a.help for a in self._actions if flag in (a.option_strings or [a.dest])), None)
            what = f" ({text.split(' (')[0]})" if text else ""
            raise UserError(f"{flag}: {value} is not {expected}; give {expected}{what}")
        match = re.fullmatch(r"argument (\S+): invalid choice: (.*) \(choose from (.*)\)", message)
        if match:
            flag, value, options = match.groups()
            names = [o.strip().strip("'") for o in options.split(",")]
            close = difflib.get_close_matches(value.strip("'"), names, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            what = "a raytrm command" if flag == "COMMAND" else f"one of {', '.join(names)}"
            raise UserError(f"{self.prog}: {flag}: {value} is not {what}{hint} ({see})")
        message = re.sub(r"^the following arguments are required: ", "missing ", message)
        message = re.sub(r"^argument (\S+): expected one argument$", r"\1: expected a value after it", message)
        message = re.sub(r"^argument (\S+): ", r"\1: ", message)
        raise UserError(f"{self.prog}: {message} ({see})")


def build_parser() -> argparse.ArgumentParser:
    """The `raytrm` command's parser: one subcommand per step of the flow, each added by its own `_add_*`."""
    parser = Parser(prog="raytrm", description="Train and autotune Tiny Recursive Models across a few Macs with Ray.")
    parser.add_argument("--version", action="version", version=f"raytrm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in (
        _add_probe,
        _add_validate,
        _add_data,
        _add_train,
        _add_tune,
        _add_export,
        _add_report,
        _add_import_checkpoint,
        _add_export_checkpoint,
        _add_predict,
        _add_evaluate,
        _add_cluster,
    ):
        add(sub)
    return parser


def _add_probe(sub: Any) -> None:
    """`raytrm probe`'s arguments."""
    p = sub.add_parser("probe", help="show this machine, its compute device and its tier")
    p.add_argument("--json", action="store_true", help="print a stable machine-readable document")
    p.add_argument("--tiers", metavar="FILE", help="tier table (default: the tiers.yaml raytrm ships)")
    p.set_defaults(func=cmd_probe)


def _add_validate(sub: Any) -> None:
    """`raytrm validate`'s arguments."""
    p = sub.add_parser("validate", help="check a training config, profile or tier table and show it resolved")
    p.add_argument(
        "file",
        help="a YAML file: training config, profile (raytrm_profile: 1), search space or tier table; or the name of "
        "one raytrm ships (quick, sudoku, tiers, ...)",
    )
    group = p.add_argument_group("a search space's base experiment (for hf-classify and hf-lm: your model and records)")
    _add_flags(group, SPACE_BASE_FLAGS)
    p.set_defaults(func=cmd_validate)


def _add_data(sub: Any) -> None:
    """`raytrm data`'s arguments."""
    p = sub.add_parser("data", help="generate a Sudoku or maze dataset in the TRM reference layout")
    p.add_argument("kind", choices=("sudoku", "maze"))
    p.add_argument("--out", required=True, help="dataset directory to create")
    p.add_argument("--count", type=int, default=1000, help="training puzzles before augmentation")
    p.add_argument("--test-count", type=int, default=None, help="test puzzles (default: count / 10, at least 1)")
    p.add_argument("--givens", type=int, default=36, help="Sudoku clues per puzzle (17..80; fewer is harder)")
    p.add_argument("--augment", type=int, default=0, help="augmented copies per training puzzle")
    p.add_argument("--size", type=int, default=30, help="maze side length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset directory")
    p.set_defaults(func=cmd_data)


def _add_train(sub: Any) -> None:
    """`raytrm train`'s arguments."""
    p = sub.add_parser(
        "train",
        help="train on this machine (no Ray), or on Ray Train workers with --workers/--address; without arguments, "
        "a small TRM on Sudoku",
    )
    p.add_argument("--config", metavar="FILE", help="training config (model, data, training)")
    p.add_argument(
        "--profile",
        metavar="FILE",
        action="append",
        help="a tuned profile: train with exactly its settings; with --workers/--address, once per tier",
    )
    p.add_argument("--workers", type=int, help="train on N Ray Train workers (a local Ray, or the --address cluster)")
    p.add_argument(
        "--address", help="train on a running Ray cluster (auto or HOST:PORT): one worker per machine by default"
    )
    p.add_argument(
        "--equal-shares", action="store_true", help="with several workers: keep equal shares, never rebalance"
    )
    p.add_argument(
        "--elastic",
        action="store_true",
        help="with several workers: a Mac that stops answering costs the others a deadline, not a restart, and a "
        "Mac that joins (or comes back) enters at the next round with a live peer's state",
    )
    p.add_argument("--out", metavar="RUN_DIR", help="run directory (default: runs/train-<time>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest good checkpoint")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start anew where --out holds a run: the old run is moved aside to RUN_DIR.replaced-<time>, not deleted",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress line and no INFO lines, only warnings and the summary (with --workers/--address, Ray's and "
        "the workers' lines are in RUN_DIR/logs/ with or without it)",
    )
    _add_flags(p, TRAIN_FLAGS)
    p.set_defaults(func=cmd_train)


def _add_tune(sub: Any) -> None:
    """`raytrm tune`'s arguments."""
    p = sub.add_parser("tune", help="autotune each machine tier with Ray Tune + Optuna and export a profile per tier")
    p.add_argument("--space", metavar="FILE", help="search space: a file, or a shipped one by name (default: quick)")
    p.add_argument("--trials", type=int, default=None, help="trials per tier (default: the space's)")
    p.add_argument("--out", metavar="RUN_DIR", help="run directory (default: runs/tune-<time>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a tuning run whose driver stopped")
    p.add_argument("--address", help="Ray cluster: auto or HOST:PORT (default: start a local Ray)")
    group = p.add_argument_group(
        "the space's base experiment (hf-classify, hf-lm: your model and records, at the same path on every machine)"
    )
    _add_flags(group, SPACE_BASE_FLAGS)
    p.set_defaults(func=cmd_tune)


def _add_export(sub: Any) -> None:
    """`raytrm export`'s arguments."""
    p = sub.add_parser("export", help="write the profile of a tuning run's best settings")
    p.add_argument("run_dir", help="a `raytrm tune` run directory")
    p.add_argument("--tier", help="the tier to export (default: every tuned tier, into RUN_DIR/profiles/)")
    p.add_argument("--out", metavar="FILE", help="profile file to write (with --tier)")
    p.add_argument(
        "--format",
        choices=("profile", "hf"),
        default="profile",
        help="profile: raytrm's profile (YAML); hf: a Hugging Face model's settings as transformers' TrainingArguments "
        "fields, with the max length and threads (JSON, for your own training script)",
    )
    p.set_defaults(func=cmd_export)


def _add_report(sub: Any) -> None:
    """`raytrm report`'s arguments."""
    p = sub.add_parser("report", help="plot a training run and say what limited it, or show a tuning run's results")
    p.add_argument("run_dir", help="a `raytrm train` or `raytrm tune` run directory")
    p.add_argument("--out", metavar="DIR", help="where to write the plots and the text (default: RUN_DIR/report)")
    p.set_defaults(func=cmd_report)


def _add_import_checkpoint(sub: Any) -> None:
    """`raytrm import-checkpoint`'s arguments."""
    p = sub.add_parser("import-checkpoint", help="load a TRM reference checkpoint into a new raytrm run")
    p.add_argument("checkpoint", help="a state_dict saved by the reference (keys _orig_mod.model.inner.*)")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory to create")
    p.add_argument("--config", metavar="FILE", help="training config matching the checkpoint's model")
    p.set_defaults(func=cmd_import_checkpoint)


def _add_export_checkpoint(sub: Any) -> None:
    """`raytrm export-checkpoint`'s arguments."""
    p = sub.add_parser("export-checkpoint", help="write a run's weights in the TRM reference layout")
    p.add_argument("run_dir", help="a raytrm run directory")
    p.add_argument("--out", required=True, metavar="FILE", help="file to write")
    p.add_argument("--raw-weights", action="store_true", help="export the raw weights instead of the EMA")
    p.set_defaults(func=cmd_export_checkpoint)


def _add_predict(sub: Any) -> None:
    """`raytrm predict`'s arguments."""
    p = sub.add_parser("predict", help="label records with a trained Hugging Face classifier (RUN_DIR/model)")
    p.add_argument("run_dir", help="a `raytrm train --model hf` run directory")
    p.add_argument("records", help="a CSV, JSONL or Parquet file of records with the run's text fields")
    p.add_argument(
        "--out", metavar="FILE", help="CSV of each record's label and score (default: RECORDS.predictions.csv)"
    )
    p.set_defaults(func=cmd_predict)


def _add_evaluate(sub: Any) -> None:
    """`raytrm evaluate`'s arguments."""
    p = sub.add_parser("evaluate", help="accuracy, macro-F1 and the confusion matrix of a trained classifier")
    p.add_argument("run_dir", help="a `raytrm train --model hf` run directory")
    p.add_argument("records", help="labelled records (CSV, JSONL or Parquet) with the run's text and label fields")
    p.set_defaults(func=cmd_evaluate)


def _add_cluster(sub: Any) -> None:
    """`raytrm cluster`'s arguments."""
    p = sub.add_parser("cluster", help="make this Mac a node of a raytrm cluster: head, join, paths, status, stop")
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    for name, text in (
        ("head", "start the cluster here: Ray's head with this Mac's tier, its LAN address and a token (0600)"),
        ("join", "join a head with its token, as a node of this Mac's tier, by the fastest path to it"),
    ):
        a = actions.add_parser(name, help=text)
        a.add_argument(
            "--paths-port",
            type=port_number,
            help="the head's path service, which measures the paths between the Macs (default: Ray's port + 1)",
        )
        if name == "join":
            a.add_argument(
                "head",
                metavar="HEAD[:PORT]",
                nargs="?",
                help="the head's address, as `raytrm cluster head` printed (default: the one head found on the local "
                "network by mDNS)",
            )
        else:
            a.add_argument("--port", type=port_number, default=6379, help="the head's port (default 6379)")
            a.add_argument(
                "--autoscaling-config", metavar="FILE", help="for `ray up`: the autoscaler file it writes on the head"
            )
            a.add_argument(
                "--dashboard-host",
                default="127.0.0.1",
                help="where the dashboard (and job submission) listens: localhost unless you need it on the LAN",
            )
        a.add_argument("--node-ip", metavar="IP", help="this Mac's address (default: the LAN interface's)")
        a.add_argument("--tier", help="advertise this tier of tiers.yaml instead of the probed one")
        a.add_argument("--token-file", metavar="FILE", help="the cluster token (default: ~/.ray/auth_token)")
        a.add_argument("--object-store-mb", type=int, help="Ray's object store (default: 5%% of memory, 512-2048)")
        a.add_argument(
            "--block",
            action="store_true",
            help="stay in the foreground while the node runs (for launchd); SIGTERM stops the node",
        )
    a = actions.add_parser("paths", help="measure each path to the head (rate, latency) and show the fastest")
    a.add_argument(
        "head",
        nargs="?",
        metavar="HEAD[:PORT]",
        help="the head's address, as `raytrm cluster head` printed (default: the one head found by mDNS)",
    )
    a.add_argument("--paths-port", type=port_number, help="the head's path service (default: Ray's port + 1)")
    a.add_argument("--token-file", metavar="FILE", help="the cluster token (default: ~/.ray/auth_token)")
    a = actions.add_parser("status", help="the cluster's nodes, tiers, memory budgets and jobs")
    a.add_argument("--address", help="HEAD:PORT (default: the cluster this Mac is a node of)")
    a.add_argument("--token-file", metavar="FILE", help="the cluster token (default: ~/.ray/auth_token)")
    a.add_argument(
        "--link", action="store_true", help="also time sums between the raytrm machines: the link's rate and latency"
    )
    actions.add_parser("stop", help="stop this Mac's node")
    p.set_defaults(func=cmd_cluster)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: user errors print one line and exit 2, without a traceback."""
    logging.basicConfig(
        level=os.environ.get(LOG_LEVEL_ENV, DEFAULT_LOG_LEVEL).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UserError as e:
        print(f"raytrm: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("raytrm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
