"""Generated Sudoku and maze puzzles, written and read in the TRM reference's on-disk layout."""

from raytrm.data import maze, sudoku
from raytrm.data.build import KINDS, build_dataset, open_dataset
from raytrm.data.maze import Maze, generate_mazes, make_maze
from raytrm.data.puzzle_format import (
    IGNORE_LABEL,
    PuzzleDataset,
    PuzzleMetadata,
    group_membership,
    read_metadata,
    write_identifiers,
    write_split,
)
from raytrm.data.sudoku import SudokuPuzzle, count_solutions, generate_puzzles, make_puzzle, solved_grid

__all__ = [
    "IGNORE_LABEL",
    "KINDS",
    "Maze",
    "PuzzleDataset",
    "PuzzleMetadata",
    "SudokuPuzzle",
    "build_dataset",
    "count_solutions",
    "generate_mazes",
    "generate_puzzles",
    "group_membership",
    "make_maze",
    "make_puzzle",
    "maze",
    "open_dataset",
    "read_metadata",
    "solved_grid",
    "sudoku",
    "write_identifiers",
    "write_split",
]
