"""Model factories for validation tests: one that matches nothing, one that does not import."""

from torch import nn


def wrong_names() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64))


def broken() -> nn.Module:
    raise RuntimeError("factory exploded")


def parallelize(model: nn.Module, mesh: object) -> nn.Module:
    return model  # wrong_names' module says how to shard, so the sharded mode gets that far
