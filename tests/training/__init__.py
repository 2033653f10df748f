"""The registry inside a training loop (registry/training/): the CheckpointManager in torchrun
jobs, the store writer, tier 0 and its restores."""
