"""A Ray Train worker's console: Ray's own INFO lines (a line for every report on every worker) leave it, raytrm's
lines and everyone's warnings stay (raytrm.distributed.ray_train)."""

from __future__ import annotations

import logging

from raytrm.distributed.ray_train import _RayInfoOffConsole


def _record(path: str, level: int) -> logging.LogRecord:
    return logging.LogRecord("x", level, path, 1, "message", None, None)


def test_rays_info_lines_leave_the_console_and_the_rest_stays():
    quiet = _RayInfoOffConsole("/venv/site-packages/ray")
    assert not quiet.filter(_record("/venv/site-packages/ray/train/v2/_internal/execution/context.py", logging.INFO))
    assert quiet.filter(_record("/venv/site-packages/ray/train/v2/_internal/execution/context.py", logging.WARNING))
    assert quiet.filter(_record("/work/raytrm/train/adaptive.py", logging.INFO))
