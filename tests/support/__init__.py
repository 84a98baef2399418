"""What the tests share, and the benchmarks borrow, that no user command needs: the rig of real hosts (hosts) and the
data-parallel exactness check (equivalence)."""
