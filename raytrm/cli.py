"""The `raytrm` command: one subcommand per step of the flow."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

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
    from raytrm.hardware.tiers import load_tiers

    data = config.read_yaml(args.file)
    if isinstance(data, dict) and "raytrm_tiers" in data:
        print(f"{args.file}: valid tier table, {len(load_tiers(args.file))} tiers")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raytrm", description="Train and autotune Tiny Recursive Models across a few Macs with Ray."
    )
    parser.add_argument("--version", action="version", version=f"raytrm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("probe", help="show this machine, its compute device and its tier")
    p.add_argument("--json", action="store_true", help="print a stable machine-readable document")
    p.add_argument("--tiers", metavar="FILE", help="tier table (default: tune_spaces/tiers.yaml)")
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser("validate", help="check a training config, profile or tier table and show it resolved")
    p.add_argument("file", help="a YAML file: training config, profile (raytrm_profile: 1) or tiers.yaml")
    p.set_defaults(func=cmd_validate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: user errors print one line and exit 2, without a traceback."""
    logging.basicConfig(
        level=os.environ.get(LOG_LEVEL_ENV, DEFAULT_LOG_LEVEL).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"raytrm: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("raytrm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
