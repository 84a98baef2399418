"""A first run against a second identical run: the warm-up each pays, with compiled artifacts kept between runs.

    python examples/warm_start.py                      # the GPU run of issue 18 (TRM-attention, hidden 512), 40 steps
    python examples/warm_start.py -- --steps 20 --hidden-size 128 --config compiled.yaml   # any `raytrm train` flags

Both runs are `raytrm train` with the same flags, each in a fresh process, with RAYTRM_CACHE_DIR an empty directory:
the first compiles everything (torch's inductor and AOTAutograd caches, Triton's kernels and autotuning, cuBLASLt's
algorithm per shape all start empty), the second finds what the first kept. The dataset is generated into that
directory before either run, so neither run's setup pays for it. For each run it prints the summary's setup and
warm-up (the time to the first steady step), the steady samples/s, the process's whole time and CPU time (which
other load on the machine leaves alone), and the compile caches' hits and misses as torch counted them in that
process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

#: Issue 18's point-1 run on the GPU, without --lr: the size rule sets it.
DEFAULT_FLAGS = [
    "--device", "cuda", "--variant", "attention", "--hidden-size", "512", "--H-cycles", "3", "--L-cycles", "6",
    "--global-batch", "768", "--steps", "40",
]  # fmt: skip

#: Runs `raytrm train` in this process, then prints torch's compile-cache counters as one JSON line.
CHILD = """
import json, sys
from raytrm.cli import main
code = main(sys.argv[1:])
from torch._dynamo.utils import counters
kept = {k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd")}
print("COMPILE-CACHE " + json.dumps(kept), flush=True)
sys.exit(code)
"""


def _prepare_data(flags: list[str], env: dict[str, str]) -> None:
    """Generate the run's dataset into the fresh cache dir, outside the timed runs."""
    code = (
        "import sys; from raytrm.cli import build_parser, _overrides; from raytrm.train.run.experiment import "
        "resolve_experiment; from raytrm.data.cache import open_dataset_for; "
        "args = build_parser().parse_args(['train', *sys.argv[1:]]); "
        "e, _ = resolve_experiment(config_file=args.config, profile_file=None, out=None, resume=False, "
        "overrides=_overrides(args), tier_defaults=False); open_dataset_for(e.data) if e.model.name == 'trm' else None"
    )
    subprocess.run([sys.executable, "-c", code, *flags], env=env, check=True)


def _cpu_seconds() -> float:
    """CPU seconds (user and system) of the finished child processes so far: a machine's other load moves the
    wall time of a compilation, not this."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _run(flags: list[str], out: Path, env: dict[str, str]) -> dict:
    cpu = _cpu_seconds()
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "train", *flags, "--out", str(out), "--quiet"],
        env=env,
        capture_output=True,
        text=True,
    )
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"raytrm train failed ({done.returncode})")
    counters = next(
        (json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("COMPILE-CACHE ")),
        {},
    )
    summary = json.loads((out / "summary.json").read_text())
    lr = yaml.safe_load((out / "config.yaml").read_text())["training"]["lr"]
    return {"process_seconds": seconds, "cpu_seconds": cpu, "summary": summary, "counters": counters, "lr": lr}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("flags", nargs="*", help="`raytrm train` flags (after --); default: issue 18's GPU run")
    parser.add_argument("--cache-dir", help="use this RAYTRM_CACHE_DIR (default: a new temporary directory)")
    args = parser.parse_args()
    flags = args.flags or DEFAULT_FLAGS
    with tempfile.TemporaryDirectory(prefix="raytrm-warm-start-") as work:
        cache = args.cache_dir or str(Path(work) / "cache")
        env = {**os.environ, "RAYTRM_CACHE_DIR": cache}
        for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # the runs' caches are the fresh dir's
            env.pop(name, None)
        _prepare_data(flags, env)
        print(f"raytrm train {' '.join(flags)}  (RAYTRM_CACHE_DIR={cache})")
        print(f"{'run':<8}{'setup s':>9}{'warm-up s':>11}{'to steady s':>13}{'steps':>7}{'steady samples/s':>18}"
              f"{'process s':>11}{'CPU s':>9}  compile caches")  # fmt: skip
        for name in ("first", "second"):
            r = _run(flags, Path(work) / name, env)
            s = r["summary"]
            inductor, aot = r["counters"].get("inductor", {}), r["counters"].get("aot_autograd", {})
            caches = (
                f"fx graph hit {inductor.get('fxgraph_cache_hit', 0)} miss {inductor.get('fxgraph_cache_miss', 0)} "
                f"bypass {inductor.get('fxgraph_cache_bypass', 0)}; aot autograd hit "
                f"{aot.get('autograd_cache_hit', 0)} miss {aot.get('autograd_cache_miss', 0)} "
                f"bypass {aot.get('autograd_cache_bypass', 0)}"
            )
            steady = s.get("steady_samples_per_sec") or 0.0
            print(
                f"{name:<8}{s['setup_seconds']:>9.1f}{s['warmup_seconds']:>11.1f}"
                f"{s['setup_seconds'] + s['warmup_seconds']:>13.1f}{s['warmup_steps']:>7}{steady:>18.1f}"
                f"{r['process_seconds']:>11.1f}{r['cpu_seconds']:>9.1f}  {caches}"
            )
            scores = (
                f", eval cell accuracy {s['eval_cell_acc']:.3f} (copying the givens {s['eval_copy_givens_acc']:.3f})"
                if "eval_cell_acc" in s
                else ""
            )
            print(f"{'':<8}stopped: {s.get('stop_reason')}, lr {r['lr']:.3g}{scores}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
