"""GPU health of a burn-in candidate: bf16 matmul speed of every visible device and the driver's counters.

The counters (temperature, uncorrected ECC errors, active clock-event reasons)
come from NVML through ``nvidia-ml-py`` where it is installed, else from the
``nvidia-smi`` CLI; both give one ``DeviceHealth`` per GPU and one pure
``summarize`` turns them into the flat figures the verdict reads. Neither tool
honours ``CUDA_VISIBLE_DEVICES``, so the counters are kept only for the GPUs
this process can see (matched by UUID). Nothing here decides: the verdict does.
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from trainyard.burnin.probes import NO_THROTTLE, Throttle, matmul_gflops

MATMUL_SIZE = 8192
"""Large enough to keep every tensor core of an H100/B200 busy; 3 x 128 MiB of bf16."""

# Dense (no 2:4 sparsity) bf16 tensor-core peaks in TFLOP/s, by product name as NVML and torch report it
# ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"). NVIDIA's data sheets print the sparse figure with a
# footnote "shown with sparsity"; the dense one is half of it: H100 SXM 1,979 / PCIe 1,513 / NVL 1,671,
# H200 SXM 1,979 / NVL 1,671 (H100 and H200 data sheets); A100 312 (A100 data sheet, dense column); A10 125
# (A10 data sheet, 250 sparse); L4 121 (242 sparse); L40S 362 (733 sparse); L40 181 (362 sparse); HGX B200
# 2,250 and B100 1,750 (Blackwell data sheet, 4.5 / 3.5 PFLOPS sparse). A10G: AWS's variant, no NVIDIA data
# sheet; 70 is the figure AWS and third parties quote (a lower tensor clock than the A10), not verified.
# First match wins, so a variant precedes its family (H100 NVL before H100 80GB HBM3, H200 NVL before H200).
PEAK_BF16_TFLOPS: dict[str, float] = {
    r"\bH100\b.*\bNVL\b": 835.0,
    r"\bH100\b.*\bPCIe\b": 756.0,
    r"\bH100\b.*(\bSXM|\b80GB HBM3\b)": 989.0,
    r"\bGH200\b": 989.0,
    r"\bH200\b.*\bNVL\b": 835.0,
    r"\bH200\b": 989.0,
    r"\bA100\b": 312.0,
    r"\bA10G\b": 70.0,
    r"\bA10\b": 125.0,
    r"\bL40S\b": 362.0,
    r"\bL40\b": 181.0,
    r"\bL4\b": 121.0,
    r"\bB200\b": 2250.0,
    r"\bB100\b": 1750.0,
}

# Clock-event ("throttle") reasons, NVML's nvmlClocksEventReason* bits (the same values as the older
# nvmlClocksThrottleReason* names; nvidia-smi prints the mask as clocks_event_reasons.active). Only these
# mean a fault; idle (0x1), application clocks (0x2), the power cap (0x4), sync boost (0x10) and display
# clocks (0x100) are how a healthy GPU runs.
FAULT_THROTTLE_REASONS: dict[int, str] = {
    0x8: "hw_slowdown",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
}
FAULT_THROTTLE_MASK = sum(FAULT_THROTTLE_REASONS)

SMI_FIELDS = ("index", "uuid", "name", "temperature.gpu", "ecc.errors.uncorrected.volatile.total")
# Drivers from 535 on call the mask clocks_event_reasons; older ones know only clocks_throttle_reasons.
SMI_REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
_ABSENT = {"[N/A]", "[Not Supported]", "N/A"}


@dataclass(frozen=True)
class DeviceHealth:
    """One GPU's counters as the driver reports them; ``temperature_c`` None where it has no sensor reading."""

    index: int
    name: str
    temperature_c: float | None
    ecc_uncorrected: int
    throttle_mask: int
    uuid: str = ""


class HealthUnavailable(Exception):
    """Neither NVML nor the CLI could be read; the message says why."""


def peak_bf16_tflops(name: str) -> float | None:
    """The dense bf16 peak of the device called ``name`` (TFLOP/s), None for a product not in the table."""
    return next((peak for pattern, peak in PEAK_BF16_TFLOPS.items() if re.search(pattern, name, re.I)), None)


def throttle_names(mask: int) -> list[str]:
    """The fault reasons set in ``mask``, in bit order (the harmless reasons are left out)."""
    return [name for bit, name in sorted(FAULT_THROTTLE_REASONS.items()) if mask & bit]


def summarize(devices: Sequence[DeviceHealth]) -> dict[str, Any]:
    """The flat health figures of a node: the hottest GPU, the ECC errors of all, the fault reasons of any."""
    mask = 0
    for device in devices:
        mask |= device.throttle_mask & FAULT_THROTTLE_MASK
    temperatures = [d.temperature_c for d in devices if d.temperature_c is not None]
    return {
        "health_gpus": [d.index for d in devices],
        **({"temperature_c": max(temperatures)} if temperatures else {}),
        "temperature_c_per_device": [d.temperature_c for d in devices],
        "ecc_uncorrected": sum(d.ecc_uncorrected for d in devices),
        "ecc_uncorrected_per_device": [d.ecc_uncorrected for d in devices],
        "throttle_mask": mask,
        "throttle": throttle_names(mask),
    }


def _uuid_key(uuid: str) -> str:
    """NVML and nvidia-smi say ``GPU-<uuid>``, torch the bare ``<uuid>``."""
    text = uuid.strip().lower()
    return text.removeprefix("gpu-")


def visible_only(devices: Sequence[DeviceHealth], uuids: Sequence[str]) -> list[DeviceHealth]:
    """The devices whose UUID is in ``uuids`` (this process's GPUs); all of them when none matches
    (no UUIDs known, or MIG instances, whose UUIDs are not the parent GPU's)."""
    wanted = {_uuid_key(u) for u in uuids if u}
    mine = [d for d in devices if _uuid_key(d.uuid) in wanted]
    return mine or list(devices)


# ---- nvidia-smi


def parse_smi(text: str) -> list[DeviceHealth]:
    """``nvidia-smi --query-gpu=<SMI_FIELDS>,<reasons> --format=csv,noheader,nounits`` output, one GPU a line.

    ``[N/A]`` / ``[Not Supported]`` ECC means a device without ECC (0 errors); a
    missing temperature is None. Anything else unreadable is a ``ValueError``.
    """
    devices = []
    for line in text.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != len(SMI_FIELDS) + 1:
            raise ValueError(f"nvidia-smi line {line!r}: expected {len(SMI_FIELDS) + 1} fields")
        index, uuid, name, temperature, ecc, reasons = fields
        devices.append(
            DeviceHealth(
                index=int(index),
                name=name,
                temperature_c=None if temperature in _ABSENT else float(temperature),
                ecc_uncorrected=0 if ecc in _ABSENT else int(ecc),
                throttle_mask=0 if reasons in _ABSENT else int(reasons, 16),
                uuid=uuid,
            )
        )
    return devices


Runner = Callable[..., "subprocess.CompletedProcess[str]"]


def read_smi(smi: str | None = None, run: Runner | None = None) -> list[DeviceHealth]:
    """Every GPU's counters through the CLI, with the older drivers' field name as the fallback."""
    smi, run = smi or shutil.which("nvidia-smi"), run or subprocess.run
    if smi is None:
        raise HealthUnavailable("nvidia-smi not found")
    why = ""
    for reasons in SMI_REASON_FIELDS:
        argv = [smi, f"--query-gpu={','.join((*SMI_FIELDS, reasons))}", "--format=csv,noheader,nounits"]
        try:
            done = run(argv, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise HealthUnavailable(f"nvidia-smi: {exc}") from None
        if done.returncode == 0:
            try:
                return parse_smi(done.stdout)
            except ValueError as exc:
                raise HealthUnavailable(str(exc)) from None
        said = (done.stderr or done.stdout).strip().splitlines()
        why = f"nvidia-smi exited {done.returncode}" + (f": {said[0][:200]}" if said else "")
    raise HealthUnavailable(why)


# ---- NVML


def _nvml() -> ModuleType:
    """``pynvml`` from nvidia-ml-py, imported by name (it ships no type information)."""
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        raise HealthUnavailable("nvidia-ml-py not installed") from None


def _not_supported(nvml: ModuleType, exc: Exception) -> bool:
    return bool(getattr(exc, "value", None) == nvml.NVML_ERROR_NOT_SUPPORTED)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # nvidia-ml-py before 11.515 returned bytes


def _reasons(nvml: ModuleType, handle: object) -> int:
    """Active clock-event reasons: the 535+ name, else the older one (old library or old driver)."""
    newer = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    if newer is not None:
        try:
            return int(newer(handle))
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) != nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                raise
    return int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))


def _device(nvml: ModuleType, index: int) -> DeviceHealth:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    try:
        temperature: float | None = float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
    except nvml.NVMLError as exc:
        if not _not_supported(nvml, exc):
            raise
        temperature = None
    try:
        ecc = int(
            nvml.nvmlDeviceGetTotalEccErrors(handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
        )
    except nvml.NVMLError as exc:
        if not _not_supported(nvml, exc):
            raise
        ecc = 0  # no ECC on this device (or ECC mode off): no errors it could count
    try:
        mask = _reasons(nvml, handle)
    except nvml.NVMLError as exc:
        if not _not_supported(nvml, exc):
            raise
        mask = 0
    return DeviceHealth(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(handle)),
        temperature_c=temperature,
        ecc_uncorrected=ecc,
        throttle_mask=mask,
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
    )


def read_nvml() -> list[DeviceHealth]:
    """Every GPU's counters through NVML; ``HealthUnavailable`` when the library or the driver is missing."""
    nvml = _nvml()
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise HealthUnavailable(f"NVML init: {exc}") from None
    try:
        return [_device(nvml, i) for i in range(nvml.nvmlDeviceGetCount())]
    except nvml.NVMLError as exc:
        raise HealthUnavailable(f"NVML: {exc}") from None
    finally:
        nvml.nvmlShutdown()


def read_health(uuids: Sequence[str] = ()) -> dict[str, Any]:
    """The summarized counters of this process's GPUs and where they came from: NVML first, then the CLI."""
    whys = []
    for source, read in (("nvml", read_nvml), ("nvidia-smi", read_smi)):
        try:
            devices = read()
        except HealthUnavailable as exc:
            whys.append(f"{source}: {exc}")
            continue
        return {**summarize(visible_only(devices, uuids)), "health_source": source}
    return {"health_source": f"skipped: {'; '.join(whys)}"}


def _torch_uuids(count: int) -> list[str]:
    """The visible devices' UUIDs as CUDA reports them ([] where this torch build does not say)."""
    try:
        return [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]
    except (AttributeError, RuntimeError):
        return []


def gpu_checks(budget_s: float, throttle: Throttle = NO_THROTTLE) -> dict[str, Any]:
    """bf16 matmul TFLOP/s of every visible GPU (the slowest is the node's) and the driver's health counters;
    without CUDA, the reason it was skipped (NVML is then never loaded)."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device visible"}
    count = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    # One slow GPU of eight holds every step of a data-parallel job back: the node is as fast as its slowest.
    per_device = [
        matmul_gflops(MATMUL_SIZE, budget_s / count, throttle, device=f"cuda:{i}", dtype=torch.bfloat16) / 1e3
        for i in range(count)
    ]
    out: dict[str, Any] = {
        "devices": count,
        "name": name,
        "bf16_tflops": min(per_device),
        "bf16_tflops_per_device": per_device,
    }
    peak = peak_bf16_tflops(name)
    if peak is not None:
        out["bf16_fraction_of_peak"] = min(per_device) / peak
    return {**out, **read_health(_torch_uuids(count))}
