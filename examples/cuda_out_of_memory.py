"""Memory-adaptive batching meeting a real out-of-memory error on a CUDA GPU, and a budget held on the allocator.

GPU only: it needs a CUDA GPU (and no Ray); on a machine without one it stops at once, saying so. A Mac's MPS
allocator fails the same way and is handled the same way; this script needs CUDA to cap the allocator.

    python examples/cuda_out_of_memory.py

1. The allocator is capped at about 2 GiB and the governor is given a budget far above it, so the cut it approaches
   is too large: CUDA raises out-of-memory, and the step is redone on the same samples at half the micro-batch.
   The run completes and has seen exactly steps x global batch samples.
2. The allocator is left alone and the budget is 1.5 GiB: the governor fits its probe steps, then approaches the
   largest micro-batch whose predicted allocator peak stays under 90% of it, refitting on each step's peak.

Expected output, from a run on an H200 (torch 2.11, 2026-11-25):

    capped: choose 16 -> 32
    capped: approach 32 -> 64
    capped: out-of-memory 64 -> 32
    capped: samples seen 6144 = 6 x 1024, cut [32, 32, ..., 32], allocator peak 1974 MiB
    budget: micro-batch 19, predicted 1361 MiB, measured 1357 MiB of 1536 MiB (cuda-allocator-peak)
"""

import tempfile

import torch

from raytrm import config as cfg
from raytrm.data.build import build_dataset
from raytrm.train.run.training import run_training


def experiment(data: str, budget_mb: int) -> cfg.ExperimentConfig:
    return cfg.from_dict(
        cfg.ExperimentConfig,
        {
            "model": {"variant": "mlp_t", "hidden_size": 512, "H_cycles": 3, "L_cycles": 6},
            "data": {"path": data},
            "training": {
                "global_batch_size": 1024,
                "steps": 6,
                "memory_budget_mb": budget_mb,
                "device": "cuda",
                "log_interval": 1,
            },
        },
    )


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("this example needs a CUDA GPU")
    work = tempfile.mkdtemp()
    data = str(build_dataset("sudoku", f"{work}/sudoku", count=2048, test_count=64, givens=36))

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(2 * 2**30 / total)
    summary = run_training(experiment(data, budget_mb=200_000), f"{work}/capped")
    for event in summary["memory"]["adaptations"]:
        print("capped:", event["event"], event["micro_batch_from"], "->", event["micro_batch_to"])
    print(
        f"capped: samples seen {summary['samples_seen']} = 6 x 1024, cut {summary['micro_batches']}, "
        f"allocator peak {summary['peak_step_mb']:.0f} MiB"
    )

    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
    summary = run_training(experiment(data, budget_mb=1536), f"{work}/budget")
    memory = summary["memory"]
    print(
        f"budget: micro-batch {memory['micro_batch']}, predicted {memory['predicted_peak_mb']:.0f} MiB, "
        f"measured {summary['peak_step_mb']:.0f} MiB of 1536 MiB ({summary['peak_method']})"
    )


if __name__ == "__main__":
    main()
