"""A training run's policy around the engine: which experiment `raytrm train` runs (`experiment`, `size_rule`), its
directory (`directory`), the loop's hooks (stop rules, evaluations, the memory budget, the thermal guard, health,
peers, metrics rows and checkpoints) and `training.run_training`, which picks them and writes the summary; and the
TRM reference's checkpoints brought in and out (`reference_checkpoints`)."""
