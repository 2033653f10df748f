"""The CheckpointManager in real torchrun jobs: save through the registry, resume from it."""

from __future__ import annotations

import json

import torch

from registry import Registry
from tests.helpers import torchrun


def _torchrun(nproc: int, report, run: str = "mgr") -> None:
    args = ["--run-name", run, "--steps", "2", "--report", str(report)]
    torchrun("examples.train_with_manager", nproc, args)


def test_save_and_resume_across_world_sizes(tmp_path):
    _torchrun(2, tmp_path / "first.json")
    first = json.loads((tmp_path / "first.json").read_text())
    assert first == {"resumed": None, "start": 0, "last": 2}
    with Registry() as reg:
        listed = reg.list_checkpoints("mgr")
        assert [c["step"] for c in listed] == [1, 2]
        assert all(c["world_size"] == 2 for c in listed)  # recorded, not inferred
        assert reg.show("mgr@step2")["world_size_inferred"] is False
    # A second job on 3 ranks resumes from step 2 (resharded) and continues.
    _torchrun(3, tmp_path / "second.json")
    second = json.loads((tmp_path / "second.json").read_text())
    assert second == {"resumed": 2, "start": 2, "last": 4}
    with Registry() as reg:
        assert [c["step"] for c in reg.list_checkpoints("mgr")] == [1, 2, 3, 4]
        assert reg.show("mgr@step4")["world_size"] == 3
    # Resuming restored the exact weights: a third job resumes from step 4 and its starting
    # point equals what the second job ended with.
    ended = torch.load(tmp_path / "second.pt", weights_only=True)
    with Registry() as reg:
        reg.pull("mgr@step4", tmp_path / "pulled")
    import torch.distributed.checkpoint as dcp

    state = {k: torch.empty_like(v) for k, v in ended.items()}
    model_state = {"model": state}
    dcp.load(model_state, checkpoint_id=str(tmp_path / "pulled"))  # our own, verified copy
    assert all(torch.equal(state[k], ended[k]) for k in ended)
