"""raytrm: train and autotune Tiny Recursive Models across a few Macs with Ray."""

__version__ = "0.1.0"

from raytrm.errors import ConfigError, UserError

__all__ = ["ConfigError", "UserError", "__version__"]
