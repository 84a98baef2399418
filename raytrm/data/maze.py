"""Mazes: braided grid mazes with one shortest route from S to G, in the reference's Maze-Hard encoding.

A maze is a (size, size) uint8 grid of tokens: PAD 0, wall `#` 1, open ` ` 2, start `S` 3, goal `G` 4, path `o` 5
(vocab 6, seq_len size * size). The label is the input with the cells strictly between S and G on the shortest
route marked `o`; S and G stay.

How a maze is made: a perfect maze is carved on the odd lattice by a randomised depth-first search (long, winding
corridors), then a `braid` fraction of its dead ends is knocked through to a neighbour, which adds loops (half by
default: about 10 loops at 30x30), so there are several routes and a solver has to compare them; Maze-Hard likewise
has more than one route and long shortest paths. S is an open cell at random; G is drawn among cells whose shortest
route from S has at least `min_distance` steps (size * size // 8 by default, 112 at 30x30; routes average about 120)
and is the only shortest route, so the label is well defined. For even sizes the last lattice row and column stay
wall; a random symmetry of each maze moves that thicker edge to a random side.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import numpy as np

from raytrm.errors import UserError

logger = logging.getLogger(__name__)

PAD_ID, WALL, OPEN, START, GOAL, PATH = 0, 1, 2, 3, 4, 5
VOCAB_SIZE = 6
CHARSET = "# SGo"  # token t is CHARSET[t - 1]
MIN_SIZE = 5
DEFAULT_BRAID = 0.5


@dataclass(frozen=True)
class Maze:
    """One maze: input and label token grids (size, size) uint8, and the shortest route's length in steps."""

    input: np.ndarray
    label: np.ndarray
    distance: int


def default_min_distance(size: int) -> int:
    """Shortest-route length a maze must reach by default: size * size // 8 (112 steps at 30x30)."""
    return size * size // 8


def _carve(size: int, braid: float, rng: np.random.Generator) -> bytearray:
    """Open cells (1) of a braided lattice maze, flat, row-major."""
    lattice = [(r, c) for r in range(1, size - 1, 2) for c in range(1, size - 1, 2)]
    is_open = bytearray(size * size)
    steps = ((0, 2), (2, 0), (0, -2), (-2, 0))
    orders = [[steps[k] for k in perm] for perm in rng.permuted(np.tile(np.arange(4), (len(lattice), 1)), axis=1)]
    order_of = {cell: orders[n] for n, cell in enumerate(lattice)}
    start = lattice[int(rng.integers(len(lattice)))]
    is_open[start[0] * size + start[1]] = 1
    stack = [start]
    while stack:
        r, c = stack[-1]
        for dr, dc in order_of[(r, c)]:
            r2, c2 = r + dr, c + dc
            if 0 < r2 < size - 1 and 0 < c2 < size - 1 and not is_open[r2 * size + c2]:
                is_open[(r + dr // 2) * size + c + dc // 2] = 1
                is_open[r2 * size + c2] = 1
                stack.append((r2, c2))
                break
        else:
            stack.pop()
    for n in rng.permutation(len(lattice)).tolist():
        r, c = lattice[n]
        walls = [
            (r + dr // 2) * size + c + dc // 2 for dr, dc in steps if 0 < r + dr < size - 1 and 0 < c + dc < size - 1
        ]
        closed = [w for w in walls if not is_open[w]]
        if len(walls) - len(closed) == 1 and closed and rng.random() < braid:
            is_open[closed[int(rng.integers(len(closed)))]] = 1
    return is_open


def _bfs(is_open: bytearray, size: int, source: int) -> tuple[list[int], list[int]]:
    """Steps from `source` to every cell (-1 when unreachable) and the number of shortest routes, capped at 2."""
    dist, routes = [-1] * (size * size), [0] * (size * size)
    dist[source], routes[source] = 0, 1
    queue = deque([source])
    while queue:
        u = queue.popleft()
        du = dist[u] + 1
        for v in (u - size, u - 1, u + 1, u + size):
            if is_open[v]:
                if dist[v] < 0:
                    dist[v], routes[v] = du, routes[u]
                    queue.append(v)
                elif dist[v] == du:
                    routes[v] = min(2, routes[v] + routes[u])
    return dist, routes


def check_maze_args(size: int, min_distance: int, braid: float) -> None:
    """Raise UserError unless the maze parameters can work."""
    if not isinstance(size, int) or size < MIN_SIZE:
        raise UserError(f"maze size: got {size!r}, expected an integer >= {MIN_SIZE}; fix: pass --size 30")
    if not 0.0 <= braid <= 1.0:
        raise UserError(f"maze braid: got {braid!r}, expected a fraction in 0..1; fix: use {DEFAULT_BRAID}")
    if min_distance < 1 or min_distance > size * size // 4:
        raise UserError(
            f"maze min_distance: got {min_distance!r}, expected 1..{size * size // 4} for size {size}; fix: leave it"
            f" unset for the default {default_min_distance(size)}"
        )


def make_maze(
    rng: np.random.Generator,
    size: int = 30,
    *,
    braid: float = DEFAULT_BRAID,
    min_distance: int | None = None,
    attempts: int = 200,
) -> Maze:
    """One maze whose only shortest route from S to G has at least `min_distance` steps."""
    min_distance = default_min_distance(size) if min_distance is None else min_distance
    check_maze_args(size, min_distance, braid)
    for _ in range(attempts):
        is_open = _carve(size, braid, rng)
        cells = [i for i, o in enumerate(is_open) if o]
        for source in rng.choice(cells, size=min(4, len(cells)), replace=False).tolist():
            dist, routes = _bfs(is_open, size, source)
            far = [i for i in cells if dist[i] >= min_distance and routes[i] == 1]
            if far:
                return _finish(is_open, size, source, far[int(rng.integers(len(far)))], dist, rng)
    raise UserError(
        f"maze min_distance: no {size}x{size} maze with braid {braid} reached a unique shortest route of"
        f" {min_distance} steps in {attempts} tries; fix: lower min_distance or braid"
    )


def _finish(is_open: bytearray, size: int, source: int, goal: int, dist: list[int], rng: np.random.Generator) -> Maze:
    """Token grids for a carved maze, S and G placed, route marked, then turned by a random symmetry."""
    grid = np.where(np.frombuffer(bytes(is_open), np.uint8) > 0, OPEN, WALL).astype(np.uint8)
    grid[source], grid[goal] = START, GOAL
    label = grid.copy()
    cell = goal
    while dist[cell] > 1:
        cell = next(
            v for v in (cell - size, cell - 1, cell + 1, cell + size) if is_open[v] and dist[v] == dist[cell] - 1
        )
        label[cell] = PATH
    tid = int(rng.integers(8))
    grids = (dihedral(grid.reshape(size, size), tid), dihedral(label.reshape(size, size), tid))
    return Maze(np.ascontiguousarray(grids[0]), np.ascontiguousarray(grids[1]), dist[goal])


def generate_mazes(
    count: int,
    size: int = 30,
    *,
    seed: int = 0,
    braid: float = DEFAULT_BRAID,
    min_distance: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`count` mazes as input and label token grids, each (count, size, size) uint8; deterministic for `seed`."""
    rng = np.random.default_rng(seed)
    mazes = [make_maze(rng, size, braid=braid, min_distance=min_distance) for _ in range(count)]
    if not mazes:
        return np.zeros((0, size, size), np.uint8), np.zeros((0, size, size), np.uint8)
    logger.debug("maze: %d mazes %dx%d, mean route %.1f steps", count, size, size, np.mean([m.distance for m in mazes]))
    return np.stack([m.input for m in mazes]), np.stack([m.label for m in mazes])


def dihedral(grid: np.ndarray, tid: int) -> np.ndarray:
    """One of the 8 symmetries of the square, numbered as the reference does.

    0 identity, 1..3 rotation by 90, 180, 270 degrees counter-clockwise, 4 left-right mirror, 5 up-down mirror,
    6 transpose, 7 anti-transpose. Works on the last two axes.
    """
    rot = (-2, -1)
    transforms = {
        0: lambda g: g,
        1: lambda g: np.rot90(g, 1, rot),
        2: lambda g: np.rot90(g, 2, rot),
        3: lambda g: np.rot90(g, 3, rot),
        4: lambda g: np.flip(g, -1),
        5: lambda g: np.flip(g, -2),
        6: lambda g: np.swapaxes(g, -1, -2),
        7: lambda g: np.flip(np.rot90(g, 1, rot), -1),
    }
    if tid not in transforms:
        raise ValueError(f"dihedral transform id: got {tid!r}, expected 0..7")
    return transforms[tid](np.asarray(grid))


def to_text(grid: np.ndarray) -> str:
    """A token grid as lines of `# SGo` characters (PAD shows as `?`)."""
    chars = "?" + CHARSET
    return "\n".join("".join(chars[t] for t in row) for row in np.asarray(grid).tolist())


def from_text(text: str) -> np.ndarray:
    """Lines of `# SGo` characters back to a token grid (size, size) uint8."""
    rows = [line for line in text.splitlines() if line]
    bad = {ch for row in rows for ch in row} - set(CHARSET)
    if bad or len({len(row) for row in rows}) != 1:
        raise ValueError(f"maze text: expected equal-length lines of {CHARSET!r}, got characters {sorted(bad)}")
    return np.array([[CHARSET.index(ch) + 1 for ch in row] for row in rows], dtype=np.uint8)
