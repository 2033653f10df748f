"""The registry inside a training loop: `CheckpointManager` (manager.py) saves from every rank
straight into the store (store_writer.py) and restores with timed phases (timed_reader.py)."""

from registry.training.manager import CheckpointManager

__all__ = ["CheckpointManager"]
