"""Sudoku: solved grids, puzzles with a unique solution at a chosen number of givens, the reference's augmentations.

Grids are (9, 9) int8 arrays, 0 a blank and 1..9 the digits. Tokens follow the reference: PAD 0, blank 1, digit d
is d + 1 (vocab 11, seq_len 81, every cell supervised).

How a puzzle is made: a fresh solved grid, each cell visited once in random order, its clue removed only on proof
that the solution stays unique: with the clue's digit banned there, naked and hidden singles reach a contradiction.
Removals whose proof would need search are skipped (3 in 100 of them would have been valid), so no check backtracks.
A kept clue stays kept (fewer clues cannot restore uniqueness). A pass that ends above the target is retried on a
new grid; after `attempts` grids the fewest-givens puzzle is returned and a warning logged. 25 givens takes 1.25
grids on average; with 20 grids 22 is reached for about half the puzzles (others stop at 23..24); below 22 expect
the target to be missed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from raytrm.errors import UserError

logger = logging.getLogger(__name__)

SEQ_LEN = 81
VOCAB_SIZE = 11
PAD_ID = 0
BLANK_TOKEN = 1
MIN_GIVENS, MAX_GIVENS = 17, 80

_ALL = 0x1FF
_CONTRA, _STUCK, _SOLVED = 0, 1, 2
_CELLS = tuple((i, i // 9, i % 9, (i // 27) * 3 + (i % 9) // 3) for i in range(81))
_UNITS = tuple((kind, k, tuple(cell for cell in _CELLS if cell[1 + kind] == k)) for k in range(9) for kind in range(3))
# Per banned cell, its own three units come first: that is where a contradiction usually shows. Index -1: no ban.
_UNITS_FROM = (*(tuple(sorted(_UNITS, key=lambda u, cell=cell: cell[1 + u[0]] != u[1])) for cell in _CELLS), _UNITS)
_POPCOUNT = tuple(bin(m).count("1") for m in range(512))
_BITS = tuple(1 << d for d in range(9))
Cell = tuple[int, int, int, int]  # index, row, column, box
Masks = list[list[int]]  # digits used per row, column and box, one bit per digit


@dataclass(frozen=True)
class SudokuPuzzle:
    """A puzzle (0 = blank) and its unique solution, both (9, 9) int8."""

    puzzle: np.ndarray
    solution: np.ndarray

    @property
    def givens(self) -> int:
        """Number of clues."""
        return int(np.count_nonzero(self.puzzle))


def _state(grid: np.ndarray | list[int]) -> tuple[list[int], Masks] | None:
    """Bit-per-digit cells and row/column/box masks of a grid (0 = blank), or None when two clues clash."""
    digits = np.asarray(grid).reshape(-1).tolist()
    if len(digits) != 81 or min(digits) < 0 or max(digits) > 9:
        raise ValueError(f"a Sudoku grid has 81 cells of 0..9, got shape {np.shape(grid)}")
    vals, masks = [0] * 81, [[0] * 9, [0] * 9, [0] * 9]
    for cell, d in zip(_CELLS, digits, strict=True):
        _, r, c, b = cell
        if d and (1 << (d - 1)) & (masks[0][r] | masks[1][c] | masks[2][b]):
            return None
        _place(vals, masks, cell, 1 << (d - 1) if d else 0)
    return vals, masks


def _place(vals: list[int], masks: Masks, cell: Cell, bit: int) -> None:
    i, r, c, b = cell
    vals[i], masks[0][r], masks[1][c], masks[2][b] = bit, masks[0][r] | bit, masks[1][c] | bit, masks[2][b] | bit


def _take(vals: list[int], masks: Masks, cell: Cell, bit: int) -> None:
    i, r, c, b = cell
    vals[i], masks[0][r], masks[1][c], masks[2][b] = 0, masks[0][r] ^ bit, masks[1][c] ^ bit, masks[2][b] ^ bit


def _most_constrained(vals: list[int], masks: Masks) -> tuple[Cell | None, int]:
    """The empty cell with fewest candidates (None when the grid is full) and its candidate bits."""
    rm, cm, bm = masks
    best, best_n, options = None, 10, 0
    for cell in _CELLS:
        i, r, c, b = cell
        if not vals[i]:
            m = _ALL & ~(rm[r] | cm[c] | bm[b])
            if _POPCOUNT[m] < best_n:
                best, best_n, options = cell, _POPCOUNT[m], m
                if best_n <= 1:
                    break
    return best, options


def _propagate(vals: list[int], masks: Masks, ban_cell: int = -1, ban_bit: int = 0) -> int:
    """Place naked and hidden singles in place until none is left; returns _CONTRA, _STUCK or _SOLVED."""
    rm, cm, bm = masks
    left = vals.count(0)
    units = _UNITS_FROM[ban_cell]
    while left:
        changed = False
        for kind, k, cells in units:
            need = _ALL & ~masks[kind][k]
            if not need:
                continue
            once = twice = 0
            for i, r, c, b in cells:
                if vals[i]:
                    continue
                m = _ALL & ~(rm[r] | cm[c] | bm[b])
                if i == ban_cell:
                    m &= ~ban_bit
                if not m:
                    return _CONTRA
                if m & (m - 1):
                    twice |= once & m
                    once |= m
                else:
                    vals[i], rm[r], cm[c], bm[b] = m, rm[r] | m, cm[c] | m, bm[b] | m
                    changed, left = True, left - 1
            need &= ~masks[kind][k]
            if need & ~once:
                return _CONTRA
            hidden = need & ~twice
            while hidden:
                d = hidden & -hidden
                hidden ^= d
                for i, r, c, b in cells:
                    if not vals[i] and d & ~(rm[r] | cm[c] | bm[b]) and not (i == ban_cell and d == ban_bit):
                        break
                else:
                    return _CONTRA
                vals[i], rm[r], cm[c], bm[b] = d, rm[r] | d, cm[c] | d, bm[b] | d
                changed, left = True, left - 1
        if not changed:
            return _STUCK
    return _SOLVED


def _search(vals: list[int], masks: Masks, limit: int, found: list[list[int]]) -> int:
    """Count solutions up to `limit`: propagate, then branch on the cell with fewest candidates."""
    status = _propagate(vals, masks)
    if status != _STUCK:
        if status == _SOLVED:
            found.append(vals)
        return int(status == _SOLVED)
    cell, options = _most_constrained(vals, masks)
    total = 0
    for d in _BITS:
        if options & d and total < limit:
            v2, m2 = vals[:], [m[:] for m in masks]
            _place(v2, m2, cell, d)  # type: ignore[arg-type]  # a stuck grid has an empty cell
            total += _search(v2, m2, limit - total, found)
    return total


def _digits(vals: list[int]) -> np.ndarray:
    return np.array([m.bit_length() for m in vals], dtype=np.int8).reshape(9, 9)


def solutions(puzzle: np.ndarray, limit: int = 2) -> list[np.ndarray]:
    """Solutions of `puzzle` (0 = blank), up to `limit` of them; len() of it counts solutions."""
    state = _state(puzzle)
    found: list[list[int]] = []
    if state is not None:
        _search(*state, limit, found)
    return [_digits(vals) for vals in found]


def count_solutions(puzzle: np.ndarray, limit: int = 2) -> int:
    """Number of solutions of `puzzle` (0 = blank), counted up to `limit`."""
    return len(solutions(puzzle, limit))


def _fill(vals: list[int], masks: Masks, order: list[int]) -> bool:
    """Complete a grid in place (naked singles first, no propagation: fastest here), digits tried in `order`."""
    cell, options = _most_constrained(vals, masks)
    if cell is None:
        return True
    for d in order:
        if options & d:
            _place(vals, masks, cell, d)
            if _fill(vals, masks, order):
                return True
            _take(vals, masks, cell, d)
    return False


def _solved_vals(rng: np.random.Generator) -> list[int]:
    """A random solved grid: the three diagonal boxes at random, the rest completed in a random digit order."""
    while True:
        perms = rng.permuted(np.tile(np.arange(9), (4, 1)), axis=1)
        grid = np.zeros((9, 9), np.int64)
        for k in range(3):
            grid[3 * k : 3 * k + 3, 3 * k : 3 * k + 3] = perms[k].reshape(3, 3) + 1
        vals, masks = _state(grid)  # type: ignore[misc]  # diagonal boxes never clash
        if _fill(vals, masks, [1 << int(p) for p in perms[3]]):
            return vals


def solved_grid(rng: np.random.Generator) -> np.ndarray:
    """A random solved Sudoku grid, (9, 9) int8."""
    return _digits(_solved_vals(rng))


def _removal_keeps_unique(vals: list[int], masks: Masks, i: int, d: int) -> bool:
    """True when the puzzle stays unique without the clue `d` at cell `i` (already taken out of vals and masks)."""
    rm, cm, bm = masks
    _, r, c, b = _CELLS[i]
    if (rm[r] | cm[c] | bm[b] | d) == _ALL:
        return True  # naked single on the clues alone
    for kind, k in ((0, r), (1, c), (2, b)):
        for j, rj, cj, bj in _UNITS[3 * k + kind][2]:
            if j != i and not vals[j] and not d & (rm[rj] | cm[cj] | bm[bj]):
                break
        else:
            return True  # hidden single on the clues alone
    return _propagate(vals[:], [rm[:], cm[:], bm[:]], i, d) == _CONTRA


def _carve(solution: list[int], givens: int, best_n: int, rng: np.random.Generator) -> list[int]:
    """One removal pass; stops at `givens`, or once neither the target nor `best_n` can be reached."""
    vals = solution[:]
    masks = [[_ALL] * 9, [_ALL] * 9, [_ALL] * 9]
    n = 81
    for pos, i in enumerate(rng.permutation(81).tolist()):
        floor = n - (81 - pos)
        if n == givens or (floor > givens and floor >= best_n):
            break
        d = vals[i]
        _take(vals, masks, _CELLS[i], d)
        if _removal_keeps_unique(vals, masks, i, d):
            n -= 1
        else:
            _place(vals, masks, _CELLS[i], d)
    return vals


def check_givens(givens: int) -> None:
    """Raise UserError unless `givens` is a clue count this generator supports."""
    if not isinstance(givens, int) or not MIN_GIVENS <= givens <= MAX_GIVENS:
        raise UserError(
            f"sudoku givens: got {givens!r}, expected an integer in {MIN_GIVENS}..{MAX_GIVENS} (no Sudoku with"
            f" fewer than 17 clues has a unique solution); fix: pass --givens between {MIN_GIVENS} and"
            f" {MAX_GIVENS}, 36 is the default"
        )


def make_puzzle(rng: np.random.Generator, givens: int, *, attempts: int = 20) -> SudokuPuzzle:
    """A puzzle with a unique solution and `givens` clues, or the fewest reached in `attempts` grids."""
    check_givens(givens)
    best: tuple[list[int], list[int]] | None = None
    best_n = 82
    for _ in range(attempts):
        solution = _solved_vals(rng)
        vals = _carve(solution, givens, best_n, rng)
        n = 81 - vals.count(0)
        if n < best_n:
            best, best_n = (vals, solution), n
        if n == givens:
            break
    assert best is not None
    return SudokuPuzzle(_digits(best[0]), _digits(best[1]))


def generate_puzzles(
    count: int, givens: int = 36, *, seed: int = 0, attempts: int = 20
) -> tuple[np.ndarray, np.ndarray]:
    """`count` puzzles and their solutions, each (count, 9, 9) int8; deterministic for `seed`."""
    check_givens(givens)
    rng = np.random.default_rng(seed)
    made = [make_puzzle(rng, givens, attempts=attempts) for _ in range(count)]
    missed = [p.givens for p in made if p.givens != givens]
    if missed:
        reached = f"{min(missed)}..{max(missed)}"
        logger.warning(
            f"sudoku: {len(missed)} of {count} puzzles stopped above {givens} givens (fewest reached: {reached});"
            " below about 22 the removal pass rarely reaches the target"
        )
    puzzles = np.array([p.puzzle for p in made], dtype=np.int8).reshape(-1, 9, 9)  # reshape: also when empty
    return puzzles, np.array([p.solution for p in made], dtype=np.int8).reshape(-1, 9, 9)


def augment(puzzles: np.ndarray, solutions: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The reference's augmentation, drawn per grid and applied alike to puzzle and solution ((n, 9, 9) or (9, 9)).

    Transpose with p = 0.5, then bands and rows within each band, stacks and columns within each stack permuted,
    then digits 1..9 relabelled (blank stays 0).
    """
    single = np.asarray(puzzles).ndim == 2
    pz, sol = np.asarray(puzzles).reshape(-1, 9, 9), np.asarray(solutions).reshape(-1, 9, 9)
    n = pz.shape[0]
    digit_map = np.concatenate([np.zeros((n, 1), np.int64), rng.permuted(np.tile(np.arange(1, 10), (n, 1)), axis=1)], 1)
    flip = (rng.random(n) < 0.5)[:, None, None]

    def lines() -> np.ndarray:
        outer = rng.permuted(np.tile(np.arange(3), (n, 1)), axis=1)
        inner = rng.permuted(np.tile(np.arange(3), (n, 3, 1)), axis=2)
        return (outer[:, :, None] * 3 + inner).reshape(n, 9)

    rows, cols = lines(), lines()
    index = (np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :])

    def apply(grids: np.ndarray) -> np.ndarray:
        moved = np.where(flip, grids.transpose(0, 2, 1), grids)[index]
        return np.take_along_axis(digit_map, moved.reshape(n, 81), axis=1).reshape(n, 9, 9).astype(grids.dtype)

    out_p, out_s = apply(pz), apply(sol)
    return (out_p[0], out_s[0]) if single else (out_p, out_s)


def encode(grids: np.ndarray) -> np.ndarray:
    """Grids (..., 9, 9) with 0 = blank to reference tokens (..., 81) uint8: blank 1, digit d -> d + 1."""
    arr = np.asarray(grids)
    return (arr.reshape(*arr.shape[:-2], SEQ_LEN) + 1).astype(np.uint8)


def decode(tokens: np.ndarray) -> np.ndarray:
    """Reference tokens (..., 81) back to grids (..., 9, 9) int8 with 0 = blank."""
    arr = np.asarray(tokens).astype(np.int16) - 1
    return arr.clip(0, 9).astype(np.int8).reshape(*arr.shape[:-1], 9, 9)
