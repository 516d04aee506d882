"""How much CPU the machine's other processes took while we measured (Linux /proc).

On a shared machine a benchmark's wall times hold what the neighbours took: an action that runs
while another process holds a core is descheduled, and its time grows though our work did not.
Each process samples, at the edges of a window, the CPU seconds the whole machine used
(/proc/stat: user, nice, system, irq, softirq, steal over all cores) and those of its own family:
itself (every thread: gloo's too) and, on the first local rank of a torchrun launch, the
launcher that started it. What the machine used minus what the family used, per wall second, is
the number of cores the others took. Off Linux the machine figure is unknown (None).
`processor()` names the CPU, so that a figure says which machine it came from: the spans' extra
work differs from one host of the same kind to another.
"""
from __future__ import annotations

import os
import platform
import socket
import time
from dataclasses import dataclass
from typing import Optional, Sequence

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)      # user nice system (idle iowait) irq softirq steal


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_busy_seconds() -> Optional[float]:
    """CPU seconds every process on this machine has used since boot, or None without /proc."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    return sum(int(fields[1 + n]) for n in _BUSY_FIELDS) / _clock_ticks()


def processor() -> str:
    """The CPU as /proc/cpuinfo names it (with its family and model: a virtual machine's name is
    often only the vendor's) and the cores this process may use; the platform's words off
    Linux."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if not line.strip():
                    break                     # the first processor's block is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return f"{name}, {cores} cores"


def _launcher_seconds() -> float:
    """CPU seconds of the torchrun launcher that started this process (0 if there is none)."""
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as cmdline:
            command = cmdline.read()
        with open(f"/proc/{parent}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    if b"torch" not in command:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _clock_ticks()     # utime, stime


@dataclass(frozen=True)
class CpuSample:
    """One process's reading at one edge of a window."""

    host: str
    wall: float                       # time.perf_counter()
    machine: Optional[float]          # machine_busy_seconds()
    family: float                     # this process (all threads), plus the launcher if counted


def sample() -> CpuSample:
    """This process's reading now; the first local rank of a torchrun launch also counts the
    launcher, so that a host's family is counted once."""
    family = time.process_time()
    if os.environ.get("LOCAL_RANK") == "0":
        family += _launcher_seconds()
    return CpuSample(socket.gethostname(), time.perf_counter(), machine_busy_seconds(), family)


def others_cores(starts: Sequence[CpuSample], ends: Sequence[CpuSample]) -> Optional[float]:
    """Cores the other processes used between `starts` and `ends` (one sample per process of
    the job, in the same order), on the busiest host; None where /proc is not readable."""
    hosts: dict[str, list[tuple[CpuSample, CpuSample]]] = {}
    for start, end in zip(starts, ends):
        hosts.setdefault(start.host, []).append((start, end))
    worst: Optional[float] = None
    for pairs in hosts.values():
        first_start, first_end = pairs[0]
        if first_start.machine is None or first_end.machine is None:
            return None
        wall = first_end.wall - first_start.wall
        if wall <= 0:
            continue
        family = sum(end.family - start.family for start, end in pairs)
        cores = max(first_end.machine - first_start.machine - family, 0.0) / wall
        worst = cores if worst is None else max(worst, cores)
    return worst
