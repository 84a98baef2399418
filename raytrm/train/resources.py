"""What this process uses while it trains: its resident memory (and the peak of it) and its CPU share, as the
metrics rows and the summary report them."""

from __future__ import annotations

import psutil


class ResourceSampler:
    """Samples this process's resident memory and CPU use; keeps the peak RSS seen."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)
        self.peak_rss = self.rss()

    def rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def sample(self) -> dict[str, float]:
        rss = self.rss()
        self.peak_rss = max(self.peak_rss, rss)
        return {
            "rss_mb": rss / 2**20,
            "peak_rss_mb": self.peak_rss / 2**20,
            "cpu_percent": self._proc.cpu_percent(None),
        }
