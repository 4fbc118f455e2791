"""What the host CPU offers a training run: native bf16 matrix units and physical cores.

`bf16_unit()` names the unit that computes bf16 matmuls natively (AMX-BF16 or AVX512-BF16),
or None. It is what `model.dtype: auto` reads on CPU: without such a unit oneDNN emulates
bf16 and a bf16 step is slower than float32, with one it is faster. Measured, one thread,
(1024 x 576) @ (576 x 1536), by CPU time: an AMD EPYC with AVX512-BF16 and no AMX, float32
88 GFLOP/s through F.linear (MKL, without AVX-512 on AMD) and 215 through oneDNN
(ops/onednn.py), bf16 452 (2.1x the best float32); an Intel Xeon with AMX, F.linear float32
164 vs bf16 1,235 (7.5x). A LoRA step of SmolLM2-135M ran 1.44x faster in bf16 than in
float32 here (docs/benchmarks.md, bench_peers).
The units are detected (torch's own CPU probe where the installed torch has it, else the
kernel's /proc/cpuinfo flags), never guessed from a model name. `SLIPSTREAM_CPU_BF16=0|1`
overrides the detection (the test suite pins it to 0: its tolerances are float32's).

`default_threads()` is the intra-op thread count a CPU run uses: the physical cores this
process may run on (hyperthread siblings share one core's matrix unit and add nothing to a
GEMM), divided among the local processes of a torchrun job.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

BF16_ENV = "SLIPSTREAM_CPU_BF16"
CPUINFO = "/proc/cpuinfo"


def bf16_unit() -> str | None:
    """'AMX-BF16' or 'AVX512-BF16' when this CPU computes bf16 matmuls natively, else None."""
    override = os.environ.get(BF16_ENV, "").strip().lower()
    if override in ("0", "false", "no", "off"):
        return None
    if override in ("1", "true", "yes", "on"):
        return "forced by SLIPSTREAM_CPU_BF16=1"
    flags = _torch_flags()
    return bf16_unit_of(cpuinfo_flags() if flags is None else flags)


def bf16_unit_of(flags: Iterable[str]) -> str | None:
    """The bf16 unit a set of CPU flags (/proc/cpuinfo spelling) names, or None."""
    flags = set(flags)
    if "amx_bf16" in flags:
        return "AMX-BF16"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    return None


def _torch_flags() -> set[str] | None:
    """The bf16 flags torch's own probe reports (torch.cpu._is_*_supported), None where the
    installed torch has no such probe."""
    probes = {"amx_bf16": "_is_amx_tile_supported", "avx512_bf16": "_is_avx512_bf16_supported"}
    if not all(hasattr(torch.cpu, name) for name in probes.values()):
        return None
    return {flag for flag, name in probes.items() if getattr(torch.cpu, name)()}


def cpuinfo_flags(path: str = CPUINFO) -> set[str]:
    """The first processor's flags line of /proc/cpuinfo (empty where there is none)."""
    try:
        with open(path, encoding="utf-8", errors="ignore") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return set(value.split())
    except OSError:
        pass
    return set()


def physical_cores(path: str = CPUINFO) -> int:
    """Physical cores among the CPUs this process may run on (its affinity mask)."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux
        allowed = set(range(os.cpu_count() or 1))
    cores = set()
    try:
        with open(path, encoding="utf-8", errors="ignore") as f:
            text = f.read()
    except OSError:
        text = ""
    for block in text.split("\n\n"):
        fields = dict(
            (k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in block.splitlines())
        )
        if "processor" not in fields or not fields["processor"].isdigit():
            continue
        if int(fields["processor"]) not in allowed:
            continue
        # No core id (some VMs, Arm): each logical CPU counts as a core.
        cores.add((fields.get("physical id"), fields.get("core id", fields["processor"])))
    return max(1, len(cores) if cores else len(allowed))


def default_threads() -> tuple[int, str]:
    """(threads, why): physical cores shared among the local torchrun processes."""
    cores = physical_cores()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if local > 1:
        return max(1, cores // local), f"{cores} physical cores / {local} local processes"
    return cores, f"{cores} physical core{'s' if cores != 1 else ''}"


def set_threads(threads: int | None) -> str:
    """Set torch's intra-op threads: `threads` if given, OMP_NUM_THREADS if set (torch read it
    at start), else the physical cores. Returns the log line's words."""
    if threads is not None:
        torch.set_num_threads(threads)
        return f"{_threads(threads)} (train.threads)"
    if os.environ.get("OMP_NUM_THREADS"):
        return f"{_threads(torch.get_num_threads())} (OMP_NUM_THREADS)"
    n, why = default_threads()
    torch.set_num_threads(n)
    return f"{_threads(n)} ({why})"


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"
