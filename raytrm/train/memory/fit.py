"""The memory model: peak memory of a training step as fixed + per_sample x micro-batch, fitted from measurements.

Memory of these models is close to linear in the micro-batch (activations scale with it; weights, optimizer state
and the runtime do not), so two or three measured points predict the rest. The trainer trusts this prediction
before it trusts exceptions, because on the CPU an oversized step raises nothing: the kernel kills the process.

A micro-batch counts samples, or padded tokens for a Hugging Face classifier (raytrm.train.micro_batches): then
per_sample is per token, and a point's micro-batch is the tokens its step had in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MiB = 2**20


@dataclass
class MemoryFit:
    """peak(b) = fixed_bytes + per_sample_bytes * b, with the points it was fitted on."""

    fixed_bytes: float
    per_sample_bytes: float
    points: list[tuple[int, int]] = field(default_factory=list)

    def predict(self, micro_batch: int) -> float:
        return self.fixed_bytes + self.per_sample_bytes * micro_batch

    def largest_micro_batch(self, budget_bytes: float, margin: float = 0.1, limit: int | None = None) -> int:
        """The largest micro-batch whose predicted peak stays under (1 - margin) x budget (at least 1)."""
        if self.per_sample_bytes <= 0:
            return limit or 1
        usable = budget_bytes * (1 - margin) - self.fixed_bytes
        best = max(1, int(usable // self.per_sample_bytes))
        return min(best, limit) if limit else best

    def relative_errors(self) -> list[float]:
        """(predicted - measured) / measured at each fitted point."""
        return [(self.predict(b) - peak) / peak for b, peak in self.points]

    def to_dict(self, unit: str = "samples") -> dict[str, object]:
        """The fit for a summary: per_sample_mb, or per_token_mb where the micro-batch counts tokens."""
        return {
            "fixed_mb": self.fixed_bytes / MiB,
            f"per_{unit.removesuffix('s')}_mb": self.per_sample_bytes / MiB,
            "points": [{"micro_batch": b, "peak_mb": p / MiB} for b, p in self.points],
        }


def fit(points: list[tuple[int, int]]) -> MemoryFit:
    """Least-squares line through (micro_batch, peak_bytes) points; one point gives a zero-slope line."""
    if not points:
        raise ValueError("fit needs at least one (micro_batch, peak_bytes) point")
    xs = [float(b) for b, _ in points]
    ys = [float(p) for _, p in points]
    n = len(points)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var_x = sum((x - mean_x) ** 2 for x in xs)
    if var_x == 0:
        return MemoryFit(mean_y, 0.0, list(points))
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var_x
    # Memory never shrinks with a larger batch; a negative slope is measurement noise.
    slope = max(0.0, slope)
    return MemoryFit(mean_y - slope * mean_x, slope, list(points))


def cut(global_batch: int, micro_batch: int) -> list[int]:
    """Micro-batch sizes that add up to the global batch, each at most micro_batch, as even as possible."""
    if micro_batch < 1 or global_batch < 1:
        raise ValueError(f"batch sizes must be >= 1, got global {global_batch}, micro {micro_batch}")
    return even(global_batch, -(-global_batch // min(micro_batch, global_batch)))


def even(total: int, parts: int) -> list[int]:
    """total split into `parts` sizes as even as possible, the larger first."""
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)
