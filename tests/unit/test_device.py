"""Where a rank computes, decided without a GPU: a fake ``torch.cuda`` stands in for the hardware.

The CUDA branch's arithmetic (device index, backend, autocast dtype, refusal) is
the pure ``device.choose``; the bf16 autocast step itself runs here on the CPU,
which supports bf16 autocast too, to show it leaves weights, gradients and
optimizer state (what a checkpoint holds) in fp32.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from trainyard.runtime import device
from trainyard.workload import loop
from trainyard.workload.model import GPT, GPTConfig


class FakeCuda:
    def __init__(self, count: int):
        self.count = count

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        if not self.count:
            raise AssertionError("device_count() asked of a machine without CUDA")
        return self.count


@pytest.mark.parametrize(
    "gpus,env,expected",
    [
        (0, {}, ("cpu", "gloo", None)),
        (0, {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}, ("cpu", "gloo", None)),
        (1, {}, ("cuda:0", "nccl", torch.bfloat16)),  # python -m trainyard.workload without torchrun
        (8, {"LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8"}, ("cuda:5", "nccl", torch.bfloat16)),
    ],
)
def test_a_rank_takes_its_own_gpu_where_cuda_is_present(gpus: int, env: dict[str, str], expected: tuple) -> None:
    placed = device.current(env, FakeCuda(gpus))
    assert (placed.device, placed.backend, placed.autocast_dtype) == expected
    assert placed.index == (int(env.get("LOCAL_RANK", "0")) if gpus else None)


def test_a_rank_without_a_gpu_of_its_own_is_refused_naming_the_fields() -> None:
    with pytest.raises(ValueError, match=r"LOCAL_RANK 2 has no GPU of its own: 2 visible.*nodes.procs_per_node"):
        device.current({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3"}, FakeCuda(2))
    with pytest.raises(ValueError, match="LOCAL_RANK='x'.*the launcher sets both"):
        device.current({"LOCAL_RANK": "x"}, FakeCuda(2))


def test_autocast_computes_in_bf16_and_full_precision_is_a_no_op() -> None:
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with device.Placement("cpu", "gloo", torch.bfloat16).autocast():
        assert (a @ b).dtype == torch.bfloat16
    with device.CPU.autocast():
        assert (a @ b).dtype == torch.float32


def test_a_bf16_autocast_step_keeps_what_a_checkpoint_holds_in_fp32(one_process_group: None) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=16, n_layers=1, n_heads=2)
    bf16 = device.Placement("cpu", "gloo", torch.bfloat16)  # the CUDA path's precision, on the CPU
    model = loop.wrap(GPT(cfg), bf16)
    seen: list[torch.dtype] = []
    model.module.head.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    args = argparse.Namespace(lr=1e-2, weight_decay=0.1)
    optimizer = loop.build_optimizer(model, args)
    batch = torch.randint(0, 64, (4, 17))
    loss = loop.train_step(model, optimizer, [(batch[:, :-1], batch[:, 1:])] * 2, 1e-2, 1.0, bf16)

    assert seen == [torch.bfloat16, torch.bfloat16] and loss == pytest.approx(4.16, abs=0.3)  # ~ln(64)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    tensors = [*model_sd.values(), *(t for state in optim_sd["state"].values() for t in state.values())]
    assert tensors and {t.dtype for t in tensors} == {torch.float32}
