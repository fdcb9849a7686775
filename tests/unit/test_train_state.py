"""An optimizer handed to the runtime's checkpoints keeps its state: DCP loads only into the keys of the dict it
is given, and a fresh optimizer's ``state_dict()`` has none (``trainyard.runtime.state``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainyard.errors import TrainingFailed
from trainyard.runtime.state import OptimizerState, TrainState, stateful


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        optimizer.step()
    return model, optimizer


def moments(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [optimizer.state[p][k] for p in model.parameters() for k in ("exp_avg", "exp_avg_sq", "step")]


def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


@pytest.mark.parametrize("how", ["bare", "train_state"])
def test_a_fresh_optimizer_resumes_with_the_moments_that_were_saved(tmp_path: Path, how: str) -> None:
    def state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        if how == "bare":  # the README's recipe
            return {"model": model, "optimizer": optimizer}
        return {"train": TrainState(model, optimizer)}

    model, optimizer = trained()
    dcp.save(stateful(state(model, optimizer)), checkpoint_id=tmp_path / "ckpt")
    model2, optimizer2 = fresh()
    dcp.load(stateful(state(model2, optimizer2)), checkpoint_id=tmp_path / "ckpt")
    for saved, resumed in zip(moments(model, optimizer), moments(model2, optimizer2), strict=True):
        assert torch.equal(saved, resumed)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_bare_optimizer_loaded_by_dcp_alone_loses_its_moments(tmp_path: Path) -> None:
    """Why the runtime wraps it: the failure this module exists for, kept visible."""
    model, optimizer = trained()
    dcp.save({"model": model, "optimizer": optimizer}, checkpoint_id=tmp_path / "ckpt")
    model2, optimizer2 = fresh()
    dcp.load({"model": model2, "optimizer": optimizer2}, checkpoint_id=tmp_path / "ckpt")
    assert not optimizer2.state


def test_an_optimizer_is_keyed_by_the_parameter_names_of_its_own_module() -> None:
    model, optimizer = trained()
    other = torch.nn.Linear(2, 2)
    wrapped = stateful({"other": other, "model": model, "optimizer": optimizer, "step": 3})
    assert isinstance(wrapped["optimizer"], OptimizerState) and wrapped["optimizer"].model is model
    assert wrapped["other"] is other and wrapped["step"] == 3
    assert set(wrapped["optimizer"].state_dict()["state"]) == {n for n, _ in model.named_parameters()}
    assert stateful(wrapped) == wrapped  # applied twice, nothing more wrapped


def test_an_optimizer_without_its_module_is_refused_with_the_fix() -> None:
    _, optimizer = trained()
    with pytest.raises(TrainingFailed, match="TrainState") as caught:
        stateful({"head": torch.nn.Linear(8, 1), "optimizer": optimizer})
    assert caught.value.kind == "user_error"
