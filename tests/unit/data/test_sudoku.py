"""Sudoku generator: unique solutions checked by an independent solver, givens, determinism, augmentation."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from raytrm.data import sudoku
from raytrm.errors import UserError


def _legal(grid: list[int], cell: int) -> list[int]:
    """Digits that fit `cell` by scanning its row, column and box (no bitmasks, no propagation)."""
    r, c = divmod(cell, 9)
    br, bc = 3 * (r // 3), 3 * (c // 3)
    used = {grid[r * 9 + k] for k in range(9)} | {grid[k * 9 + c] for k in range(9)}
    used |= {grid[(br + dr) * 9 + bc + dc] for dr in range(3) for dc in range(3)}
    return [d for d in range(1, 10) if d not in used]


def independent_solutions(puzzle: np.ndarray, limit: int = 2) -> list[list[int]]:
    """Plain recursive backtracking: fill the empty cell with fewest legal digits, collect up to `limit` solutions."""
    grid = [int(x) for x in puzzle.reshape(-1)]
    found: list[list[int]] = []

    def walk() -> None:
        empty = [i for i in range(81) if grid[i] == 0]
        if not empty:
            found.append(grid[:])
            return
        cell = min(empty, key=lambda i: len(_legal(grid, i)))
        for d in _legal(grid, cell):
            grid[cell] = d
            walk()
            grid[cell] = 0
            if len(found) >= limit:
                return

    walk()
    return found


def assert_valid_solution(grid: np.ndarray) -> None:
    digits = list(range(1, 10))
    for k in range(9):
        assert sorted(grid[k, :].tolist()) == digits
        assert sorted(grid[:, k].tolist()) == digits
        r, c = 3 * (k // 3), 3 * (k % 3)
        assert sorted(grid[r : r + 3, c : c + 3].reshape(-1).tolist()) == digits


@pytest.mark.parametrize("givens,count,seed", [(30, 12, 3), (25, 6, 4), (36, 6, 5)])
def test_puzzles_have_exactly_one_solution_equal_to_the_label(givens: int, count: int, seed: int) -> None:
    puzzles, solutions = sudoku.generate_puzzles(count, givens, seed=seed)
    assert puzzles.shape == solutions.shape == (count, 9, 9)
    for puzzle, solution in zip(puzzles, solutions, strict=True):
        assert np.count_nonzero(puzzle) == givens
        assert_valid_solution(solution)
        clues = puzzle > 0
        assert (puzzle[clues] == solution[clues]).all()
        found = independent_solutions(puzzle)
        assert len(found) == 1
        assert found[0] == solution.reshape(-1).tolist()


def test_solver_counts_and_rejects() -> None:
    puzzles, solutions = sudoku.generate_puzzles(2, 30, seed=9)
    assert sudoku.count_solutions(puzzles[0]) == 1
    (only,) = sudoku.solutions(puzzles[0])
    assert (only == solutions[0]).all()
    empty = np.zeros((9, 9), np.int8)
    assert sudoku.count_solutions(empty, limit=2) == 2
    clash = empty.copy()
    clash[0, 0] = clash[0, 8] = 5
    assert sudoku.count_solutions(clash) == 0
    assert sudoku.solutions(clash) == []
    assert len(sudoku.solutions(empty, limit=3)) == 3
    # A unique puzzle with one clue removed where the independent solver sees two solutions must count 2.
    for cell in np.flatnonzero(puzzles[1]):
        weaker = puzzles[1].copy().reshape(-1)
        weaker[cell] = 0
        expected = len(independent_solutions(weaker.reshape(9, 9)))
        assert sudoku.count_solutions(weaker.reshape(9, 9)) == expected


def test_deterministic_for_a_seed() -> None:
    a = sudoku.generate_puzzles(4, 30, seed=11)
    b = sudoku.generate_puzzles(4, 30, seed=11)
    c = sudoku.generate_puzzles(4, 30, seed=12)
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    assert not (a[0] == c[0]).all()
    grid = sudoku.solved_grid(np.random.default_rng(0))
    assert_valid_solution(grid)
    assert (grid == sudoku.solved_grid(np.random.default_rng(0))).all()


def test_givens_out_of_range_is_a_user_error() -> None:
    with pytest.raises(UserError, match=r"sudoku givens: got 12, expected an integer in 17\.\.80.*--givens"):
        sudoku.generate_puzzles(1, 12)
    with pytest.raises(UserError, match="got 81"):
        sudoku.make_puzzle(np.random.default_rng(0), 81)


def test_unreachable_target_stops_at_fewest_reached_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="raytrm.data.sudoku"):
        puzzles, solutions = sudoku.generate_puzzles(1, 17, seed=0, attempts=2)
    assert (puzzles[0][puzzles[0] > 0] == solutions[0][puzzles[0] > 0]).all()
    givens = int(np.count_nonzero(puzzles[0]))
    assert 17 < givens < 30
    assert len(independent_solutions(puzzles[0])) == 1
    assert "1 of 1 puzzles stopped above 17 givens" in caplog.text


def test_augmentation_keeps_puzzles_valid_and_unique() -> None:
    puzzles, solutions = sudoku.generate_puzzles(3, 28, seed=21)
    rng = np.random.default_rng(0)
    many_p, many_s = sudoku.augment(np.repeat(puzzles, 40, 0), np.repeat(solutions, 40, 0), rng)
    assert many_p.dtype == puzzles.dtype and many_p.shape == (120, 9, 9)
    assert len({s.tobytes() for s in many_s}) > 110  # distinct shuffles
    for k, (p, s) in enumerate(zip(many_p, many_s, strict=True)):
        assert_valid_solution(s)
        clues = p > 0
        assert clues.sum() == 28
        assert (p[clues] == s[clues]).all()
        if k % 20 == 0:
            assert independent_solutions(p) == [s.reshape(-1).tolist()]
    single_p, single_s = sudoku.augment(puzzles[0], solutions[0], rng)
    assert single_p.shape == (9, 9) and (single_p[single_p > 0] == single_s[single_p > 0]).all()


def test_augmentation_moves_whole_bands_and_stacks_alike_in_both_arrays() -> None:
    """Mark band 0 in one array and stack 0 in the other (blank stays blank under relabelling) and follow them."""
    band0 = np.zeros((9, 9), np.int8)
    band0[:3, :] = 1
    stack0 = band0.T.copy()
    n = 400
    a_band, a_stack = sudoku.augment(
        np.repeat(band0[None], n, 0), np.repeat(stack0[None], n, 0), np.random.default_rng(1)
    )
    bands = [{0, 1, 2}, {3, 4, 5}, {6, 7, 8}]
    transposed = 0
    for ab, ast in zip(a_band > 0, a_stack > 0, strict=True):
        assert ab.sum() == ast.sum() == 27
        full_rows = {int(i) for i in np.flatnonzero(ab.all(axis=1))}
        if full_rows:  # not transposed: band 0 is a whole band of rows, stack 0 a whole stack of columns
            assert full_rows in bands and {int(j) for j in np.flatnonzero(ast.all(axis=0))} in bands
        else:  # transposed alike in both arrays
            assert {int(j) for j in np.flatnonzero(ab.all(axis=0))} in bands
            assert {int(i) for i in np.flatnonzero(ast.all(axis=1))} in bands
            transposed += 1
    assert 0.4 < transposed / n < 0.6


def test_tokens_follow_the_reference_encoding() -> None:
    puzzles, solutions = sudoku.generate_puzzles(2, 30, seed=1)
    tokens = sudoku.encode(puzzles)
    assert tokens.shape == (2, sudoku.SEQ_LEN) and tokens.dtype == np.uint8
    assert set(np.unique(tokens).tolist()) <= set(range(1, 11))
    assert (tokens[puzzles.reshape(2, 81) == 0] == sudoku.BLANK_TOKEN).all()
    assert (tokens.reshape(2, 9, 9)[puzzles > 0] == puzzles[puzzles > 0] + 1).all()
    labels = sudoku.encode(solutions)
    assert labels.min() >= 2 and labels.max() <= sudoku.VOCAB_SIZE - 1  # every cell supervised
    assert (sudoku.decode(tokens) == puzzles).all()
