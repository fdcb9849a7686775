"""What a checkpoint and a joiner carry of a training loop: a module and its optimizers as DCP ``Stateful`` values.

``torch.distributed.checkpoint.load`` loads into the keys of the state dict it is given, and a fresh
optimizer's ``state_dict()`` has no ``state`` yet: a bare optimizer resumed that way keeps its parameter groups
and silently loses its moments (AdamW's ``exp_avg``/``exp_avg_sq``, momentum buffers), and the loss spikes after
every resume. ``TrainState`` saves and loads through ``get_state_dict``/``set_state_dict``, which materialise the
optimizer's state before DCP reads into it and key it by parameter name, the same with or without DDP's
``module.`` prefix, so a checkpoint is independent of the wrapper and the world size.

``stateful(state)`` is what every checkpoint call of the runtime applies to the state a script hands it: an
optimizer next to the module it optimizes is wrapped as ``OptimizerState`` by itself, so the plain recipe
``{"model": module, "optimizer": optimizer}`` keeps the optimizer's state too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from trainyard.errors import TrainingFailed


class TrainState(Stateful):
    """A model and its optimizer as one ``Stateful``, over the bare module (the wrapper belongs to a group).

    DCP calls ``state_dict()`` only when it saves or loads, so a fresh run never materialises (and thereby
    perturbs) optimizer state before its first step.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )


class OptimizerState(Stateful):
    """An optimizer's state keyed by the parameter names of ``model`` (``stateful`` wraps a bare optimizer)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state_dict)


def stateful(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with each bare optimizer wrapped as ``OptimizerState`` over the module of the same state.

    The module is the one value of ``state`` that holds every parameter the optimizer steps. An optimizer with
    no such module (its parameters spread over several, or a module missing) is an error that says what to
    hand instead, since a checkpoint without its moments would resume silently wrong.
    """
    modules = [v for v in state.values() if isinstance(v, torch.nn.Module)]
    wrapped: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.optim.Optimizer):
            wrapped[key] = OptimizerState(_module_of(key, value, modules), value)
        else:
            wrapped[key] = value
    return wrapped


def _module_of(key: str, optimizer: torch.optim.Optimizer, modules: list[torch.nn.Module]) -> torch.nn.Module:
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in modules:
        if stepped <= {id(p) for p in module.parameters()}:
            return module
    raise TrainingFailed(
        f"the checkpoint state's optimizer {key!r} steps parameters of no single module in the same state: "
        "put the model beside it ({'model': model, 'optimizer': optimizer}) or hand "
        "trainyard.runtime.TrainState(model, optimizer)",
        kind="user_error",
    )
