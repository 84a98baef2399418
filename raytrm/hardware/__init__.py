"""Hardware: what this machine is (probe), how to compute on it (device) and which tier it belongs to."""

from raytrm.hardware.probe import HardwareInfo, detect
from raytrm.hardware.tiers import Tier, load_tiers, match_tier

__all__ = ["HardwareInfo", "Tier", "detect", "load_tiers", "match_tier"]
