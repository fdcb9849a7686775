"""GPU health of a burn-in candidate (``trainyard.burnin.gpu``) with the figures real GPUs report.

No GPU is needed: nvidia-smi's output is text, NVML is a fake ``pynvml`` module
built on the real package's constants and error classes (the test below checks
that it names only what the real one has), and torch's view of the devices is
patched. The last tests cover the split of a multi-GPU host between local candidates.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pynvml
import pytest
import torch

from trainyard.burnin import gpu
from trainyard.burnin.gpu import (
    FAULT_THROTTLE_MASK,
    DeviceHealth,
    HealthUnavailable,
    parse_smi,
    peak_bf16_tflops,
    read_health,
    read_smi,
    summarize,
    throttle_names,
)

UUIDS = [f"GPU-3f5a2c1e-8b7d-4e2f-9a61-0c4d5e6f7a8{i}" for i in range(8)]

# `nvidia-smi --query-gpu=index,uuid,name,temperature.gpu,ecc.errors.uncorrected.volatile.total,
# clocks_event_reasons.active --format=csv,noheader,nounits` on an 8 x H100 node under load: most GPUs
# capped by the power limit (0x4, healthy), GPU 3 with 2 uncorrected ECC errors, GPU 5 hot and in HW thermal
# slowdown (0x40, with the HW slowdown bit 0x8 it sets), GPU 7 with ECC turned off ("[N/A]").
H100_NODE = "\n".join(
    [
        f"0, {UUIDS[0]}, NVIDIA H100 80GB HBM3, 61, 0, 0x0000000000000004",
        f"1, {UUIDS[1]}, NVIDIA H100 80GB HBM3, 63, 0, 0x0000000000000004",
        f"2, {UUIDS[2]}, NVIDIA H100 80GB HBM3, 59, 0, 0x0000000000000000",
        f"3, {UUIDS[3]}, NVIDIA H100 80GB HBM3, 62, 2, 0x0000000000000004",
        f"4, {UUIDS[4]}, NVIDIA H100 80GB HBM3, 60, 0, 0x0000000000000004",
        f"5, {UUIDS[5]}, NVIDIA H100 80GB HBM3, 91, 0, 0x0000000000000048",
        f"6, {UUIDS[6]}, NVIDIA H100 80GB HBM3, 58, 0, 0x0000000000000001",
        f"7, {UUIDS[7]}, NVIDIA H100 80GB HBM3, 60, [N/A], 0x0000000000000004",
    ]
)


# ---- nvidia-smi


def test_an_h100_nodes_csv_gives_one_device_health_per_gpu() -> None:
    devices = parse_smi(H100_NODE + "\n")
    assert [d.index for d in devices] == list(range(8))
    assert devices[3] == DeviceHealth(3, "NVIDIA H100 80GB HBM3", 62.0, 2, 0x4, UUIDS[3])
    assert devices[5].temperature_c == 91.0 and devices[5].throttle_mask == 0x48
    assert devices[7].ecc_uncorrected == 0  # ECC off: "[N/A]", nothing it could count


def test_the_node_summary_is_the_hottest_gpu_all_ecc_errors_and_only_the_fault_reasons() -> None:
    figures = summarize(parse_smi(H100_NODE))
    assert figures["temperature_c"] == 91.0
    assert figures["ecc_uncorrected"] == 2
    assert figures["ecc_uncorrected_per_device"] == [0, 0, 0, 2, 0, 0, 0, 0]
    # The power cap (0x4) and idle (0x1) on the other GPUs are how a healthy GPU runs: left out.
    assert figures["throttle_mask"] == 0x48
    assert figures["throttle"] == ["hw_slowdown", "hw_thermal_slowdown"]
    assert figures["health_gpus"] == list(range(8))


def test_a_missing_temperature_is_not_a_zero_and_an_empty_node_has_no_errors() -> None:
    line = f"0, {UUIDS[0]}, NVIDIA A10G, [N/A], [Not Supported], [Not Supported]"
    [device] = parse_smi(line)
    assert device.temperature_c is None and device.ecc_uncorrected == 0 and device.throttle_mask == 0
    assert "temperature_c" not in summarize([device])
    assert summarize([]) == {
        "health_gpus": [],
        "temperature_c_per_device": [],
        "ecc_uncorrected": 0,
        "ecc_uncorrected_per_device": [],
        "throttle_mask": 0,
        "throttle": [],
    }


def test_an_unreadable_smi_line_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="expected 6 fields"):
        parse_smi("0, NVIDIA H100 80GB HBM3, 61, 0")
    with pytest.raises(ValueError):
        parse_smi(f"0, {UUIDS[0]}, NVIDIA H100 80GB HBM3, 61, [GPU is lost], 0x0")


class FakeSmi:
    """``subprocess.run`` for nvidia-smi: a driver before 535 knows only ``clocks_throttle_reasons``."""

    def __init__(self, knows: str, stdout: str = H100_NODE):
        self.knows, self.stdout = knows, stdout
        self.calls: list[tuple[list[str], dict[str, Any]]] = []

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append((argv, kwargs))
        field = argv[1].rsplit(",", 1)[1]
        if field != self.knows:
            said = f"Field \"{field}\" is not a valid field to query.\n\nPlease run 'nvidia-smi -h' for help.\n"
            return subprocess.CompletedProcess(argv, 2, stdout=said, stderr="")
        return subprocess.CompletedProcess(argv, 0, stdout=self.stdout + "\n", stderr="")


def test_an_older_driver_is_asked_again_with_the_throttle_reasons_field_name() -> None:
    smi = FakeSmi(knows="clocks_throttle_reasons.active")
    devices = read_smi("/usr/bin/nvidia-smi", smi)
    assert len(devices) == 8 and devices[5].throttle_mask == 0x48
    asked = [argv for argv, _ in smi.calls]
    assert [a[1].rsplit(",", 1)[1] for a in asked] == ["clocks_event_reasons.active", "clocks_throttle_reasons.active"]
    assert asked[0][0] == "/usr/bin/nvidia-smi" and asked[0][2] == "--format=csv,noheader,nounits"
    assert all(kw["timeout"] > 0 and "shell" not in kw for _, kw in smi.calls)  # an argument list, bounded


def test_a_current_driver_is_asked_once() -> None:
    smi = FakeSmi(knows="clocks_event_reasons.active")
    assert len(read_smi("/usr/bin/nvidia-smi", smi)) == 8 and len(smi.calls) == 1


def test_an_smi_that_refuses_both_names_says_what_it_said() -> None:
    with pytest.raises(HealthUnavailable, match=r'exited 2: Field "clocks_throttle_reasons.active" is not a valid'):
        read_smi("/usr/bin/nvidia-smi", FakeSmi(knows="nothing"))


# ---- NVML: a fake pynvml that behaves like the real one


class FakeNvml:
    """The state behind a fake ``pynvml``: GPUs, the driver's age, and init/shutdown accounting."""

    def __init__(self, gpus: list[dict[str, Any]], driver: bool = True, event_reasons: bool = True):
        self.gpus, self.driver, self.event_reasons, self.inits = gpus, driver, event_reasons, 0

    def module(self) -> ModuleType:
        real, fake = pynvml, ModuleType("pynvml")
        for name in dir(real):  # the real constants and error classes (NVMLError(3) is an NVMLError_NotSupported)
            if name.startswith(("NVML_", "NVMLError", "nvmlClocks")):
                setattr(fake, name, getattr(real, name))
        for name in (
            "nvmlInit",
            "nvmlShutdown",
            "nvmlDeviceGetCount",
            "nvmlDeviceGetHandleByIndex",
            "nvmlDeviceGetName",
            "nvmlDeviceGetUUID",
            "nvmlDeviceGetTemperature",
            "nvmlDeviceGetTotalEccErrors",
            "nvmlDeviceGetCurrentClocksThrottleReasons",
            "nvmlDeviceGetCurrentClocksEventReasons",
        ):
            setattr(fake, name, getattr(self, name))
        return fake

    def _up(self) -> None:
        if self.inits <= 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def nvmlInit(self) -> None:
        if not self.driver:  # what this machine's real pynvml raises: no libnvidia-ml.so.1
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self._up()
        self.inits -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._up()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        self._up()
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def _get(self, handle: dict[str, Any], key: str) -> Any:
        self._up()
        value = handle[key]
        if isinstance(value, int) and key != "uuid" and value < 0:  # a negative value: this NVML error code
            raise pynvml.NVMLError(-value)
        return value

    def nvmlDeviceGetName(self, handle: dict[str, Any]) -> str:
        return str(self._get(handle, "name"))

    def nvmlDeviceGetUUID(self, handle: dict[str, Any]) -> str:
        return str(self._get(handle, "uuid"))

    def nvmlDeviceGetTemperature(self, handle: dict[str, Any], sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return int(self._get(handle, "temp"))

    def nvmlDeviceGetTotalEccErrors(self, handle: dict[str, Any], kind: int, counter: int) -> int:
        assert (kind, counter) == (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        return int(self._get(handle, "ecc"))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: dict[str, Any]) -> int:
        if not self.event_reasons:  # a driver before 535 has no such symbol
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return int(self._get(handle, "reasons"))

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: dict[str, Any]) -> int:
        return int(self._get(handle, "reasons"))


NOT_SUPPORTED = -pynvml.NVML_ERROR_NOT_SUPPORTED


def h100(i: int, temp: int = 60, ecc: int = 0, reasons: int = 0x4) -> dict[str, Any]:
    return {"name": "NVIDIA H100 80GB HBM3", "uuid": UUIDS[i], "temp": temp, "ecc": ecc, "reasons": reasons}


def test_the_fake_pynvml_names_only_what_the_real_one_has() -> None:
    fake = FakeNvml([h100(0)]).module()
    for name in dir(fake):
        if not name.startswith("__"):
            assert hasattr(pynvml, name), name
    assert isinstance(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED), pynvml.NVMLError_NotSupported)
    # The fault bits are NVML's own values.
    faults = (
        pynvml.nvmlClocksEventReasonHwSlowdown
        | pynvml.nvmlClocksEventReasonSwThermalSlowdown
        | pynvml.nvmlClocksEventReasonHwThermalSlowdown
        | pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
    )
    assert FAULT_THROTTLE_MASK == faults == pynvml.nvmlClocksThrottleReasonHwSlowdown | 0x20 | 0x40 | 0x80


def use(monkeypatch: pytest.MonkeyPatch, nvml: FakeNvml | None) -> None:
    """``import pynvml`` finds the fake (None: nvidia-ml-py is not installed)."""
    monkeypatch.setitem(sys.modules, "pynvml", None if nvml is None else nvml.module())


def no_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu.shutil, "which", lambda name: None)


def test_nvml_reads_every_gpu_then_shuts_down(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml([h100(0), h100(1, ecc=2), h100(2, temp=88, reasons=0x40 | 0x8 | 0x4), h100(3)])
    use(monkeypatch, nvml)
    figures = read_health()
    assert figures["health_source"] == "nvml"
    assert figures["ecc_uncorrected"] == 2 and figures["temperature_c"] == 88.0
    assert figures["throttle_mask"] == 0x48 and figures["throttle"] == ["hw_slowdown", "hw_thermal_slowdown"]
    assert nvml.inits == 0


def test_a_consumer_card_without_ecc_on_an_old_driver_reads_as_no_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    card = {"name": "NVIDIA GeForce RTX 4090", "uuid": UUIDS[0], "temp": 45, "ecc": NOT_SUPPORTED, "reasons": 0x20}
    use(monkeypatch, FakeNvml([card], event_reasons=False))
    figures = read_health()
    assert figures["health_source"] == "nvml" and figures["ecc_uncorrected"] == 0
    assert figures["throttle"] == ["sw_thermal_slowdown"]  # from the older call, the newer one missing


def test_without_an_nvml_driver_the_cli_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    use(monkeypatch, FakeNvml([], driver=False))
    smi = FakeSmi(knows="clocks_event_reasons.active")
    monkeypatch.setattr(gpu.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(gpu.subprocess, "run", smi)
    figures = read_health()
    assert figures["health_source"] == "nvidia-smi" and figures["ecc_uncorrected"] == 2


def test_without_nvidia_ml_py_or_nvidia_smi_the_figures_say_why_they_are_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    use(monkeypatch, None)
    no_smi(monkeypatch)
    assert read_health() == {
        "health_source": "skipped: nvml: nvidia-ml-py not installed; nvidia-smi: nvidia-smi not found"
    }
    use(monkeypatch, FakeNvml([], driver=False))
    assert read_health()["health_source"].startswith("skipped: nvml: NVML init: NVML Shared Library Not Found;")


def test_a_gpu_nvml_cannot_read_falls_back_and_nvml_is_still_shut_down(monkeypatch: pytest.MonkeyPatch) -> None:
    lost = {**h100(1), "temp": -pynvml.NVML_ERROR_GPU_IS_LOST}
    nvml = FakeNvml([h100(0), lost])
    use(monkeypatch, nvml)
    no_smi(monkeypatch)
    assert read_health()["health_source"] == "skipped: nvml: NVML: GPU is lost; nvidia-smi: nvidia-smi not found"
    assert nvml.inits == 0


def test_only_the_gpus_this_process_sees_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    # NVML lists the whole host; this candidate was given GPUs 2 and 3 (torch gives bare UUIDs).
    use(monkeypatch, FakeNvml([h100(i, ecc=5 if i == 0 else 0) for i in range(4)]))
    figures = read_health([UUIDS[2].removeprefix("GPU-"), UUIDS[3].removeprefix("GPU-")])
    assert figures["health_gpus"] == [2, 3] and figures["ecc_uncorrected"] == 0
    # UUIDs that match none (MIG instances): the whole host rather than nothing.
    assert read_health(["MIG-1d2c"])["health_gpus"] == [0, 1, 2, 3]


# ---- the figures of gpu_checks


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA A10G", 70.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L40", 181.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA B100", 1750.0),
        ("NVIDIA GeForce RTX 4090", None),
        ("Tesla V100-SXM2-16GB", None),
    ],
)
def test_the_dense_bf16_peak_by_product_name(name: str, peak: float | None) -> None:
    assert peak_bf16_tflops(name) == peak


def test_throttle_names_are_the_fault_bits_only() -> None:
    assert throttle_names(0) == [] and throttle_names(0x1 | 0x2 | 0x4 | 0x10 | 0x100) == []
    assert throttle_names(0xA0) == ["sw_thermal_slowdown", "hw_power_brake_slowdown"]
    assert throttle_names(FAULT_THROTTLE_MASK) == [
        "hw_slowdown",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
    ]


def test_without_cuda_nothing_loads_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu, "_nvml", lambda: pytest.fail("NVML loaded on a machine without CUDA"))
    monkeypatch.setattr(gpu, "read_smi", lambda: pytest.fail("nvidia-smi run on a machine without CUDA"))
    assert gpu.gpu_checks(1.0) == {"skipped": "no CUDA device visible"}


def test_the_node_is_as_fast_as_its_slowest_gpu_and_counts_only_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # This candidate sees 2 of the host's 8 H100s (CUDA_VISIBLE_DEVICES=4,5); GPU 5 is hot and slow.
    mine = [4, 5]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    props = [SimpleNamespace(uuid=UUIDS[i].removeprefix("GPU-")) for i in mine]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    measured: list[tuple[str, float, torch.dtype]] = []

    def matmul(size: int, budget_s: float, throttle: object, device: str, dtype: torch.dtype) -> float:
        measured.append((device, budget_s, dtype))
        return {"cuda:0": 742_000.0, "cuda:1": 531_000.0}[device]  # GFLOP/s

    monkeypatch.setattr(gpu, "matmul_gflops", matmul)
    use(monkeypatch, FakeNvml([h100(i, temp=90 if i == 5 else 60, ecc=3 if i == 0 else 0) for i in range(8)]))
    figures = gpu.gpu_checks(4.0)
    assert measured == [("cuda:0", 2.0, torch.bfloat16), ("cuda:1", 2.0, torch.bfloat16)]  # the budget split
    assert figures["devices"] == 2 and figures["name"] == "NVIDIA H100 80GB HBM3"
    assert figures["bf16_tflops"] == 531.0 and figures["bf16_tflops_per_device"] == [742.0, 531.0]
    assert figures["bf16_fraction_of_peak"] == pytest.approx(531.0 / 989.0)
    assert figures["health_source"] == "nvml" and figures["health_gpus"] == mine
    assert figures["temperature_c"] == 90.0 and figures["ecc_uncorrected"] == 0  # GPU 0's errors are not ours


def test_an_unknown_device_has_no_fraction_of_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA GeForce RTX 4090")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=UUIDS[0][4:]))
    monkeypatch.setattr(gpu, "matmul_gflops", lambda *a, **k: 160_000.0)
    use(monkeypatch, None)
    no_smi(monkeypatch)
    figures = gpu.gpu_checks(1.0)
    assert figures["bf16_tflops"] == 160.0 and "bf16_fraction_of_peak" not in figures
    assert figures["health_source"].startswith("skipped: ")


# ---- local candidates on a multi-GPU host


def test_two_local_candidates_of_two_gpus_each_get_their_own_halves() -> None:
    from trainyard.backends.local.probes import candidate_gpus
    from trainyard.burnin.local import candidate_env

    parent = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    gpus = candidate_gpus(["node-0", "node-1"], 2, parent)
    assert gpus == {"node-0": "0,1", "node-1": "2,3"}
    assert candidate_env("node-1", "ab" * 32, parent, gpus=gpus["node-1"])["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_a_spare_candidate_reuses_a_share_and_too_few_gpus_is_refused() -> None:
    from trainyard.backends.local.probes import candidate_gpus
    from trainyard.errors import SpecError

    parent = {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c,GPU-d"}
    # Local candidates probe one at a time, so a spare measuring node-0's share never overlaps with it.
    assert candidate_gpus(["node-0", "node-1", "node-2"], 2, parent) == {
        "node-0": "GPU-a,GPU-b",
        "node-1": "GPU-c,GPU-d",
        "node-2": "GPU-a,GPU-b",
    }
    with pytest.raises(SpecError, match="nodes.gpus_per_node: 1 node"):
        candidate_gpus(["node-0"], 8, parent)


def test_without_gpus_per_node_a_candidate_sees_what_the_worker_sees() -> None:
    from trainyard.backends.local.probes import candidate_gpus
    from trainyard.burnin.local import candidate_env

    parent = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert candidate_gpus(["node-0", "node-1"], 0, parent) == {}
    assert candidate_env("node-0", "ab" * 32, parent)["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_a_local_candidates_process_is_started_with_its_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from trainyard.backends.local import probes
    from trainyard.burnin.local import candidate_env

    started: list[dict[str, str]] = []

    class Popen:
        def __init__(self, argv: list[str], **kwargs: Any):
            started.append(kwargs["env"])

    monkeypatch.setattr(probes.subprocess, "Popen", Popen)
    probes.LocalCandidate("node-1", [], tmp_path / "node-1.log", candidate_env("node-1", "ab" * 32, gpus="2,3"))
    assert started[0]["CUDA_VISIBLE_DEVICES"] == "2,3" and started[0]["TRAINYARD_NODE"] == "node-1"
