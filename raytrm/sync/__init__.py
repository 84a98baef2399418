"""How data-parallel workers combine their work, without Ray: the contract a Trainer is handed, the process-group
implementation of it, the sync modes (exact, compressed, local rounds), the choice among them from a measured link,
the shares of a global batch between unequal workers, and what the workers exchange after a step.

A worker's Trainer builds one `SyncStrategy` per run over the collectives it is handed; adding a sync mode means one
new module here that registers a `Mode` (raytrm.sync.mode), and its tests.
"""

from raytrm.sync.contract import GradientSync, LocalSync
from raytrm.sync.mode import REGISTRY, Mode, Reduced
from raytrm.sync.strategy import Outcome, SyncStrategy

__all__ = ["REGISTRY", "GradientSync", "LocalSync", "Mode", "Outcome", "Reduced", "SyncStrategy"]
