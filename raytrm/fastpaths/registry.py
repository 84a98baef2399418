"""The one place where a named operation is given a device fast path, or runs its plain formula.

An operation is a plain PyTorch formula with a name, defined with `op` where the formula lives (raytrm.models.ops).
A backend serves an operation under conditions it states itself: a `Backend` record holds its `why_not` (the
operation's arguments -> None where it serves them, else a few words on why not) and its `run` (the same arguments
-> the operation's result, the formula's within rounding). `choose` asks an operation's backends in their order
(raytrm.fastpaths lists them) and takes the first that serves; where none does, the formula runs. Each outcome is
logged once per operation and device, with the reason: the backend's name, or why each backend declined. A backend
that composes operations (one inside another) calls the inner one by name through `call`, as a model does.

One switch turns every backend off: the environment variable RAYTRM_FASTPATHS=off (raytrm.constants; default on).
Every operation then runs its plain formula, on any device.

Under torch.compile the choice is traced: its conditions read tensor metadata, grad mode and fixed device facts
(raytrm.fastpaths.device), and the log is written from a function torch.compile takes as a constant, so the choice
costs no graph break and nothing at run time.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from raytrm.constants import DEFAULT_FASTPATHS, FASTPATHS_ENV, fastpaths_setting
from raytrm.errors import UserError
from raytrm.fastpaths.device import constant_under_compile

logger = logging.getLogger(__name__)


def fastpaths_on() -> bool:
    """Whether device fast paths may serve raytrm's operations: $RAYTRM_FASTPATHS, on (the default) or off."""
    value = fastpaths_setting()
    if value not in ("on", "off"):
        raise UserError(
            f"{FASTPATHS_ENV}={value!r}: expected on or off; unset it for the default ({DEFAULT_FASTPATHS})"
        )
    return value == "on"


#: Whether backends may serve operations (RAYTRM_FASTPATHS); tests turn it off to compare with the plain formulas.
ENABLED = fastpaths_on()


class Backend(NamedTuple):
    """A fast path of one named operation."""

    op: str  # the operation it serves
    name: str  # its name in the log
    why_not: Callable[..., str | None]  # the operation's arguments -> None where it serves them, else why not
    run: Callable[..., Any]  # the operation's arguments -> its result


_backends: dict[str, tuple[Backend, ...]] = {}
_formulas: dict[str, Callable[..., Any]] = {}
_logged: set[tuple[str, torch.device, str | None]] = set()
_SWITCHED_OFF = (("every backend", f"switched off ({FASTPATHS_ENV}=off)"),)


def register(*backends: Backend) -> None:
    """Add backends, each after those of its operation registered before it (the order `choose` asks them in)."""
    for backend in backends:
        _backends[backend.op] = (*_backends.get(backend.op, ()), backend)


def op(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: `formula` is the plain formula of the operation `name`; calls run a backend that serves them, or
    the formula."""

    def define(formula: Callable[..., Any]) -> Callable[..., Any]:
        _formulas[name] = formula

        @functools.wraps(formula)
        def operation(*args: Any, **kwargs: Any) -> Any:
            return call(name, *args, **kwargs)

        return operation

    return define


def choose(name: str, *args: Any, **kwargs: Any) -> Callable[..., Any] | None:
    """The `run` of the first backend of operation `name` that serves these arguments, or None for the plain
    formula. The first argument of every operation is a tensor, whose device the log names."""
    device = args[0].device
    if not ENABLED:
        _decided(name, device, None, _SWITCHED_OFF)
        return None
    declined: tuple[tuple[str, str], ...] = ()
    for backend in _backends.get(name, ()):
        why = backend.why_not(*args, **kwargs)
        if why is None:
            _decided(name, device, backend.name, declined)
            return backend.run
        declined += ((backend.name, why),)
    _decided(name, device, None, declined)
    return None


def call(name: str, *args: Any, **kwargs: Any) -> Any:
    """Operation `name` on these arguments: the backend `choose` picks, or its plain formula."""
    fast = choose(name, *args, **kwargs)
    return (_formulas[name] if fast is None else fast)(*args, **kwargs)


def formula(name: str) -> Callable[..., Any]:
    """The plain formula of operation `name` (defined where it lives, with `op`)."""
    return _formulas[name]


def served(name: str, *args: Any, **kwargs: Any) -> bool:
    """Whether a backend serves operation `name` on these arguments (nothing logged)."""
    if ENABLED:
        for backend in _backends.get(name, ()):
            if backend.why_not(*args, **kwargs) is None:
                return True
    return False


def backends(name: str | None = None) -> tuple[Backend, ...]:
    """The backends of operation `name` (of every operation where None), in the order they are asked."""
    if name is not None:
        return _backends.get(name, ())
    return tuple(backend for group in _backends.values() for backend in group)


@constant_under_compile
def _decided(name: str, device: torch.device, backend: str | None, declined: tuple[tuple[str, str], ...]) -> bool:
    """Log a choice the first time it is made for this operation and device. A constant to torch.compile, which
    calls it while tracing: the log costs no graph break."""
    key = (name, device, backend)
    if key not in _logged:
        _logged.add(key)
        why = "; ".join(f"{other}: {reason}" for other, reason in declined)
        if backend is not None:
            logger.info("%s on %s: fast path %s%s", name, device, backend, f" (before it, {why})" if why else "")
        else:
            logger.debug("%s on %s: the plain formula (%s)", name, device, why or "no backend serves it")
    return True
