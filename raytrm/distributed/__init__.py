"""Data-parallel training across unequal workers: gradient sync, batch shares, Ray Train glue."""
