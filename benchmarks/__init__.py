"""The measurements behind docs/performance.md, run from the repository root as `python -m benchmarks WHAT [flags]`.

A plain folder outside the installed package: it imports raytrm, raytrm never imports it. Each benchmark times a
row and its reference side by side in one run, prints a table and, with --json, writes the rows.
"""
