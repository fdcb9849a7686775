"""A state tree from one rank to the others of the default group: how a joiner (or a member behind) receives
the model and optimizer state in an in-place regroup (``trainyard.runtime.elastic``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _Slot:
    """Where a tensor was in a broadcast state tree: the tensors travel apart, one flat buffer per dtype."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _hollow(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """``tree`` with each tensor replaced by its ``_Slot`` (the tensor appended to ``tensors``)."""
    if isinstance(tree, torch.Tensor):
        tensors.append(tree)
        return _Slot(len(tensors) - 1, tuple(tree.shape), tree.dtype)
    if isinstance(tree, Mapping):
        return {k: _hollow(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_hollow(v, tensors) for v in tree)
    return tree


def _slots(tree: Any) -> list[_Slot]:
    if isinstance(tree, _Slot):
        return [tree]
    if isinstance(tree, Mapping):
        return [s for v in tree.values() for s in _slots(v)]
    if isinstance(tree, list | tuple):
        return [s for v in tree for s in _slots(v)]
    return []


def _fill(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(tree, _Slot):
        return tensors[tree.index]
    if isinstance(tree, Mapping):
        return {k: _fill(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_fill(v, tensors) for v in tree)
    return tree


def broadcast_tree(tree: Any, src: int) -> Any:
    """``tree`` (nested dicts and lists of tensors and plain values, as a ``state_dict``) from rank ``src``
    to every rank of the default group; ``tree`` is only read on ``src``. What is received is on the CPU (a
    GPU's tensors travel over the group's gloo side); ``load_state_dict`` puts it where the module is.

    Its shape and plain values go as one object, its tensors as one flat buffer per dtype: pickling a
    model's and optimizer's tensors into an object broadcast copies and serialises every byte twice more.
    """
    sender = dist.get_rank() == src
    tensors: list[torch.Tensor] = []
    box: list[Any] = [_hollow(tree, tensors) if sender else None]
    dist.broadcast_object_list(box, src=src)
    slots = _slots(box[0])
    received: list[torch.Tensor] = list(tensors) if sender else [torch.empty(0)] * len(slots)
    for dtype in dict.fromkeys(slot.dtype for slot in slots):
        group = [slot for slot in slots if slot.dtype == dtype]
        sizes = [math.prod(slot.shape) for slot in group]
        if sender:
            flat = torch.cat(
                [tensors[slot.index].detach().reshape(-1) for slot in group]
            ).cpu()  # on GPUs too: gloo's side
        else:
            flat = torch.empty(sum(sizes), dtype=dtype)
        dist.broadcast(flat, src=src)
        if not sender:
            for slot, piece in zip(group, torch.split(flat, sizes), strict=True):
                received[slot.index] = piece.view(slot.shape)
    return _fill(box[0], received)
