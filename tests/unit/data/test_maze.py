"""Maze generator: labels are the one shortest route (checked by an independent BFS), symmetries keep that."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from raytrm.data import maze
from raytrm.errors import UserError


def independent_bfs(grid: np.ndarray, source: tuple[int, int]) -> tuple[dict, dict]:
    """Distances and numbers of shortest routes (capped at 2) over non-wall cells, on (row, col) pairs."""
    size = grid.shape[0]
    dist, routes = {source: 0}, {source: 1}
    frontier = deque([source])
    while frontier:
        r, c = frontier.popleft()
        for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if not (0 <= nr < size and 0 <= nc < size) or grid[nr, nc] == maze.WALL:
                continue
            if (nr, nc) not in dist:
                dist[(nr, nc)] = dist[(r, c)] + 1
                routes[(nr, nc)] = routes[(r, c)]
                frontier.append((nr, nc))
            elif dist[(nr, nc)] == dist[(r, c)] + 1:
                routes[(nr, nc)] = min(2, routes[(nr, nc)] + routes[(r, c)])
    return dist, routes


def assert_label_is_the_shortest_route(grid: np.ndarray, label: np.ndarray, min_distance: int = 1) -> int:
    (start,) = [tuple(int(v) for v in x) for x in np.argwhere(grid == maze.START)]
    (goal,) = [tuple(int(v) for v in x) for x in np.argwhere(grid == maze.GOAL)]
    assert set(np.unique(grid).tolist()) <= {maze.WALL, maze.OPEN, maze.START, maze.GOAL}
    changed = label != grid
    assert (label[changed] == maze.PATH).all() and (grid[changed] == maze.OPEN).all()
    route = {tuple(int(v) for v in x) for x in np.argwhere(label == maze.PATH)} | {start, goal}
    dist, routes = independent_bfs(grid, start)
    assert dist[goal] == len(route) - 1 >= min_distance
    assert routes[goal] == 1  # the label is the only shortest route
    for cell in route:  # a simple chain from S to G: the ends have one route neighbour, the rest two
        r, c = cell
        neighbours = {(r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)} & route
        assert len(neighbours) == (1 if cell in (start, goal) else 2)
        assert all(abs(dist[n] - dist[cell]) == 1 for n in neighbours)
    return dist[goal]


@pytest.mark.parametrize("size,count,seed", [(30, 6, 0), (11, 20, 1), (12, 20, 2)])
def test_labels_are_verified_shortest_routes(size: int, count: int, seed: int) -> None:
    inputs, labels = maze.generate_mazes(count, size, seed=seed)
    assert inputs.shape == labels.shape == (count, size, size) and inputs.dtype == np.uint8
    for grid, label in zip(inputs, labels, strict=True):
        assert assert_label_is_the_shortest_route(grid, label, maze.default_min_distance(size)) >= size * size // 8
        border = np.concatenate([grid[0], grid[-1], grid[:, 0], grid[:, -1]])
        assert (border == maze.WALL).all()


def test_every_small_size_works() -> None:
    for size in range(maze.MIN_SIZE, 13):
        inputs, labels = maze.generate_mazes(10, size, seed=size)
        for grid, label in zip(inputs, labels, strict=True):
            assert_label_is_the_shortest_route(grid, label, maze.default_min_distance(size))


def test_braided_mazes_have_loops_and_long_routes() -> None:
    inputs, _ = maze.generate_mazes(5, 30, seed=3)
    for grid in inputs:
        open_cells = {tuple(x) for x in np.argwhere(grid != maze.WALL)}
        edges = sum(1 for r, c in open_cells for n in ((r + 1, c), (r, c + 1)) if n in open_cells)
        assert edges - len(open_cells) + 1 >= 3  # independent cycles of the open-cell graph: a perfect maze has 0
    perfect, _ = maze.generate_mazes(1, 30, seed=3, braid=0.0)
    open_cells = {tuple(x) for x in np.argwhere(perfect[0] != maze.WALL)}
    edges = sum(1 for r, c in open_cells for n in ((r + 1, c), (r, c + 1)) if n in open_cells)
    assert edges == len(open_cells) - 1


def test_dihedral_symmetries_keep_the_route_and_follow_the_reference_numbering() -> None:
    inputs, labels = maze.generate_mazes(2, 14, seed=4)
    grid, label = inputs[0], labels[0]
    distance = assert_label_is_the_shortest_route(grid, label)
    seen = set()
    for tid in range(8):
        g, lab = maze.dihedral(grid, tid), maze.dihedral(label, tid)
        assert assert_label_is_the_shortest_route(g, lab) == distance
        seen.add(g.tobytes())
    assert len(seen) == 8
    assert (maze.dihedral(grid, 1) == np.rot90(grid)).all()
    assert (maze.dihedral(grid, 4) == grid[:, ::-1]).all() and (maze.dihedral(grid, 5) == grid[::-1, :]).all()
    assert (maze.dihedral(grid, 6) == grid.T).all() and (maze.dihedral(grid, 7) == grid[::-1, ::-1].T).all()
    for tid, inverse in enumerate([0, 3, 2, 1, 4, 5, 6, 7]):
        assert (maze.dihedral(maze.dihedral(grid, tid), inverse) == grid).all()
    batch = maze.dihedral(inputs, 3)  # works on stacks too
    assert (batch[1] == maze.dihedral(inputs[1], 3)).all()


def test_deterministic_for_a_seed_and_text_round_trip() -> None:
    a = maze.generate_mazes(3, 15, seed=7)
    b = maze.generate_mazes(3, 15, seed=7)
    c = maze.generate_mazes(3, 15, seed=8)
    assert (a[0] == b[0]).all() and (a[1] == b[1]).all()
    assert not (a[0] == c[0]).all()
    text = maze.to_text(a[1][0])
    assert set(text) <= set(maze.CHARSET + "\n") and len(text.splitlines()) == 15
    assert (maze.from_text(text) == a[1][0]).all()


def test_bad_arguments_are_user_errors() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(UserError, match=r"maze size: got 3, expected an integer >= 5"):
        maze.make_maze(rng, 3)
    with pytest.raises(UserError, match=r"maze min_distance: got 500, expected 1\.\.225 for size 30"):
        maze.make_maze(rng, 30, min_distance=500)
    with pytest.raises(UserError, match="maze braid"):
        maze.make_maze(rng, 30, braid=1.5)
