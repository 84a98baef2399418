"""Memory of a training step: the governor that chooses the cut of a global batch into micro-batches (`governor`),
the fit of a step's peak against its micro-batch (`fit`), the step's measured peak (`peak`), and an allocator's
refusal recognised as out-of-memory (`oom`). The loop's hook over them is raytrm.train.run.memory_budget."""
