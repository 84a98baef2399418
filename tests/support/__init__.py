"""What tests share and the benchmarks borrow: the two-host rig (hosts), which no user command needs."""
