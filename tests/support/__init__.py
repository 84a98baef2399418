"""What the tests share, and the benchmarks borrow, that no user command needs: the two-host rig (hosts) and the
data-parallel exactness check (equivalence)."""
