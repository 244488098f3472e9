"""Measurement helpers: interleaved repetitions, robust statistics, FLOPs and memory.

Noise on a shared machine is handled by *interleaving*: every repetition runs each
candidate once (in a rotating order), so a burst of load hits all of them alike, and
ratios are taken *per repetition* (paired) before their median is reported.
"""

from __future__ import annotations

import json
import os
import resource
import time
from typing import Any, Callable, Dict, List, Mapping, Optional

import jax
import numpy as np

# Dense (no sparsity) peak throughput in FLOP/s by device kind and compute dtype, from the
# vendors' data sheets. Used only to report a fraction of peak; unknown devices get None.
PEAK_FLOPS = {
    "H200": {"float32": 67e12, "tf32": 494e12, "bfloat16": 989e12, "float16": 989e12},
    "H100": {"float32": 67e12, "tf32": 494e12, "bfloat16": 989e12, "float16": 989e12},
    "A100": {"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12},
}


def interleaved(fns: Mapping[str, Callable[[], float]], reps: int, warmup: int = 1) -> Dict[str, List[float]]:
    """Run ``reps`` rounds; each round calls every ``fn`` once, in a rotating order.

    Each ``fn()`` runs its workload, blocks until it is done and returns seconds per unit
    (e.g. per step). ``warmup`` rounds run first and are discarded.
    """
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"interleaved: `reps`={reps!r} must be an integer >= 1.")
    names = list(fns)
    out: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(warmup + reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t = fns[name]()
            if r >= warmup:
                out[name].append(t)
    return out


def stats(samples: List[float]) -> Dict[str, float]:
    """Median, quartiles, min, max and count of positive samples (seconds or ratios)."""
    a = np.asarray(samples, dtype=float)
    p25, med, p75 = np.percentile(a, [25, 50, 75])
    return {"median": float(med), "p25": float(p25), "p75": float(p75), "min": float(a.min()),
            "max": float(a.max()), "n": int(a.size)}


def paired_ratio(num: List[float], den: List[float]) -> Dict[str, float]:
    """Statistics of ``num[r] / den[r]`` over repetitions ``r`` of one interleaved run."""
    return stats([a / b for a, b in zip(num, den)])


def timer(run: Callable[[], Any], inner: int) -> Callable[[], float]:
    """A ``fn()`` for :func:`interleaved`: ``inner`` calls of ``run`` (which returns something
    blockable), blocked on at the end; returns seconds per call."""

    def fn() -> float:
        t = time.perf_counter()
        out = None
        for _ in range(inner):
            out = run()
        jax.block_until_ready(out)
        return (time.perf_counter() - t) / inner

    return fn


def flops_of(compiled: Any) -> Optional[float]:
    """FLOPs of one call of a compiled executable, from XLA's HLO cost analysis."""
    try:
        ca = compiled.cost_analysis()
    except Exception:  # some backends do not implement it
        return None
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    f = (ca or {}).get("flops")
    return float(f) if f is not None and f > 0 else None


def cost_of(compiled: Any) -> Dict[str, Optional[float]]:
    """XLA's HLO cost analysis of one call of a compiled executable: ``flops`` and
    ``bytes_accessed`` (None where the backend does not report them)."""
    try:
        ca = compiled.cost_analysis()
    except Exception:  # some backends do not implement it
        ca = None
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    ca = ca or {}
    pick = lambda k: float(ca[k]) if ca.get(k) is not None and ca[k] > 0 else None  # noqa: E731
    return {"flops": pick("flops"), "bytes_accessed": pick("bytes accessed")}


def memory_of(compiled: Any) -> Dict[str, Optional[int]]:
    """XLA's static buffer sizes for a compiled executable (bytes): temp, arguments, outputs."""
    try:
        ma = compiled.memory_analysis()
    except Exception:
        ma = None
    keys = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
    return {k.replace("_size_in_bytes", "_bytes"): (int(getattr(ma, k)) if ma is not None else None) for k in keys}


def device_info() -> Dict[str, Any]:
    """Backend, device, versions, and a hash of the jaxamp sources measured (they evolve)."""
    import hashlib
    from pathlib import Path

    import jaxamp

    h = hashlib.sha1()
    for f in sorted(Path(jaxamp.__file__).parent.rglob("*.py")):
        h.update(f.read_bytes())
    d = jax.devices()[0]
    return {"backend": jax.default_backend(), "device_kind": d.device_kind, "n_devices": jax.device_count(),
            "cpu_count": os.cpu_count(), "jax": jax.__version__, "jaxamp_sources_sha1": h.hexdigest()[:12]}


def peak_flops(device_kind: str, mode_dtype: str) -> Optional[float]:
    """Dense peak FLOP/s for a device kind (matched by substring) and dtype key, else None."""
    for name, table in PEAK_FLOPS.items():
        if name.lower() in device_kind.lower():
            return table.get(mode_dtype)
    return None


def rss_bytes() -> int:
    """Current resident set size of this process (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far: ``VmHWM`` of ``/proc/self/status`` on
    Linux. Not ``ru_maxrss``: Linux carries it across ``execve``, so a child started by a
    big parent reports the parent's peak (seen: three modes all "2632.6 MiB", the
    parent's size after the step and orders sections). ``ru_maxrss`` where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def device_peak_bytes() -> Optional[int]:
    """Peak device memory in use (GPU/TPU allocator statistics), or None (e.g. on CPU)."""
    try:
        s = jax.devices()[0].memory_stats()
    except Exception:
        return None
    return int(s["peak_bytes_in_use"]) if s and "peak_bytes_in_use" in s else None


def save(record: Dict[str, Any], out: Optional[str]) -> None:
    """Write ``record`` as JSON to ``out`` (None: nowhere), with the host's load average at the
    end (other work on the host skews CPU timings: it is recorded)."""
    if hasattr(os, "getloadavg"):
        record["host_load_avg_1min_at_end"] = round(os.getloadavg()[0], 2)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(record, f, indent=1)
