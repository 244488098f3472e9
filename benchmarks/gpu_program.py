"""``python -m benchmarks gpu_program``: the train steps' GPU program, compiled for an H100 without a GPU.

XLA compiles for an NVIDIA GPU on a machine that has none (deviceless ahead-of-time compilation,
``../shared/tools/gpu_aot``): the result is the program an H100 would run. For each step (the 2-D
Poisson PINN of the README, a Flax tanh MLP, and Modulus' lid-driven cavity of ``benchmarks/ldc.py``
at Modulus' size, a 6 x 512 SiLU ``FullyConnected``: ``--problems``; each in every precision mode of
:data:`MODES`) this reads from the optimized GPU HLO:

- the kernels: every instruction of the entry computation that launches work (fusions, Triton
  GEMM fusions, cuBLAS custom calls, copies, ...), the kernels of a ``while`` body times its known
  trip count, and of a ``conditional`` each branch (the totals take the larger branch: an upper
  bound; ``kernels_min`` the smaller);
- the bytes each kernel reads and writes: its operands and its result, each once, in full, at its
  dtype (no cache reuse, no partial reads: a model, not a profile);
- the FLOPs by dtype: ``dot`` instructions (``2 * result size * contracted size``) keyed by the
  dtype of their lhs operand, float32 ``dot``s at ``HIGHEST`` precision as ``f32`` (CUDA cores)
  and otherwise as ``tf32``; every other arithmetic instruction one FLOP per result element
  (reductions: per operand element) as ``vector`` work;
- device memory (``compiled.memory_analysis()``): temporaries, arguments, outputs.

The time model, per kernel: ``max(bytes / HBM bandwidth, sum over dtypes FLOPs / peak)`` plus a
launch cost per kernel and per conditional (its predicate's read-back), 4 us without command buffers
(CUDA graphs) and 1 us with them. Constants: :data:`DEVICES`, :data:`LAUNCH_S`.

Set-up (a venv of its own, outside the repository, never in the project's dependencies)::

    python3 -m venv /work/gpu_venv
    echo 'import site; site.addsitedir("<repo>/.venv/lib/python3.11/site-packages")' \\
        > /work/gpu_venv/lib/python3.11/site-packages/project_venv.pth
    /work/gpu_venv/bin/pip install --no-deps jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2
    /work/gpu_venv/bin/python -m benchmarks gpu_program [--sizes 4x128:20000,4x512:6000] [--modes ...]

Host callbacks cannot be lowered for an absent backend: the steps run ``jaxamp.optimizer`` with
``on_stall=None``.

On a lent GPU, ``--time REPS`` compiles the same steps for the local device instead of the description
and times each (median of REPS runs), beside the model of that device's program (``benchmarks/gpu.sh``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

PLUGIN_MODULE = "jax_plugins.xla_cuda12"  # what jax-cuda12-plugin installs
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TARGET = os.path.join(HERE, "..", "..", "shared", "tools", "gpu_aot", "h100.txtpb")

# Dense peaks (no sparsity), FLOP/s by the dtype of a dot's operands; "vector": CUDA-core float32,
# used for every non-dot FLOP. HBM bytes/s. H100 SXM and H200 SXM share the GH100 die (132 SMs,
# same clocks): the H200 row applies its bandwidth to the program compiled for the H100.
_HOPPER_PEAKS = {"f32": 67e12, "tf32": 494e12, "bf16": 989e12, "f16": 989e12, "f8": 1979e12, "vector": 67e12}
DEVICES = {"H100 SXM": {"hbm": 3.35e12, "peaks": _HOPPER_PEAKS},
           "H200 SXM": {"hbm": 4.8e12, "peaks": _HOPPER_PEAKS}}
LAUNCH_S = {"launch": 4e-6, "command_buffer": 1e-6}  # per kernel: plain launches / inside a CUDA graph

# ---------------------------------------------------------------------------------------------
# HLO text: computations, instructions, shapes
# ---------------------------------------------------------------------------------------------

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = ")
# no work of their own: names, views, tuples; "-done" halves of async pairs
_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier", "after-all",
              "add-dependency", "partition-id", "replica-id", "domain"}
# moves or views data, no arithmetic (their bytes count, not their FLOPs)
_NO_FLOPS = _NO_KERNEL | {"broadcast", "reshape", "transpose", "slice", "concatenate", "pad", "copy", "iota",
                          "dynamic-slice", "dynamic-update-slice", "gather", "scatter", "reverse", "convert",
                          "bitcast-convert", "fusion", "call", "custom-call", "while", "conditional"}


@dataclasses.dataclass
class Instr:
    name: str
    shape: str  # the result's shape text, e.g. "f32[8,4]{1,0}" or "(f16[8]{0}, pred[])"
    op: str
    operands: List[str]
    attrs: str  # everything after the operand list

    def attr(self, key: str) -> Optional[str]:
        """The value of ``key=%comp`` / ``key="text"`` / ``key={...}`` in the attributes, if present."""
        m = re.search(r"(?:^|[\s,])" + re.escape(key) + r"=(\{[^}]*\}|\"[^\"]*\"|%?[\w.\-]+)", self.attrs)
        return m.group(1).strip('"').lstrip("%") if m else None

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""


@dataclasses.dataclass
class Computation:
    name: str
    instrs: List[Instr]
    shapes: Dict[str, str]  # instruction name -> result shape text


def _balanced(text: str, start: int) -> int:
    """The index after the bracket that closes the one at ``text[start]``."""
    open_, close = text[start], {"(": ")", "{": "}", "[": "]"}[text[start]]
    depth = 0
    for i in range(start, len(text)):
        depth += (text[i] == open_) - (text[i] == close)
        if depth == 0:
            return i + 1
    raise ValueError(f"unbalanced {open_!r} in HLO text: {text[start:start + 80]!r}")


def _split_top(text: str) -> List[str]:
    """``text`` split at its top-level commas."""
    parts, depth, last = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "({[") - (ch in ")}]")
        if ch == "," and depth == 0:
            parts.append(text[last:i])
            last = i + 1
    parts.append(text[last:])
    return [p.strip() for p in parts if p.strip()]


def parse_instr(line: str) -> Optional[Instr]:
    """One HLO instruction line, or None when the line is none."""
    m = _NAME.match(line)
    if not m:
        return None
    rest = line[m.end():]
    end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:end], rest[end:]
    op = re.match(r"\s*([a-z][\w\-]*)\(", rest)
    if not op:
        return None
    close = _balanced(rest, op.end() - 1)
    operands = [re.findall(r"%?([\w.\-]+)$", o)[0] for o in _split_top(rest[op.end():close - 1])
                if re.search(r"%[\w.\-]+$", o)]
    return Instr(m.group(1), shape, op.group(1), operands, rest[close:])


def parse_module(text: str) -> Tuple[Dict[str, Computation], str]:
    """``({name: Computation}, entry name)`` of an HLO module's text."""
    comps: Dict[str, Computation] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            head = _HEADER.match(line)
            if head and not line.startswith(("HloModule", " ")):
                current = Computation(head.group(2), [], {})
                entry = head.group(2) if head.group(1) else entry
            continue
        if line.startswith("}"):
            comps[current.name], current = current, None
            continue
        ins = parse_instr(line)
        if ins is not None:
            current.instrs.append(ins)
            current.shapes[ins.name] = ins.shape
    return comps, entry


def arrays(shape: str) -> List[Tuple[str, Tuple[int, ...]]]:
    """The ``(dtype, dims)`` of every array in a shape text (a tuple's elements in order)."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(shape)]


def dtype_bytes(dtype: str) -> float:
    if dtype.startswith("f8"):
        return 1
    if dtype in ("s4", "u4"):
        return 0.5
    return _BYTES[dtype]


def shape_bytes(shape: str, skip_workspace: bool = False) -> float:
    """Bytes of a shape text (a tuple: the sum of its arrays; ``skip_workspace``: without s8/u8
    arrays, a cuBLAS custom call's scratch)."""
    return sum(math.prod(dims) * dtype_bytes(dt) for dt, dims in arrays(shape)
               if not (skip_workspace and dt in ("s8", "u8")))


def size(shape: str) -> int:
    """Elements of a shape text's first array."""
    found = arrays(shape)
    return math.prod(found[0][1]) if found else 0


# ---------------------------------------------------------------------------------------------
# FLOPs by dtype
# ---------------------------------------------------------------------------------------------

def _dot_key(lhs_dtype: str, attrs: str) -> str:
    """The peak a dot runs at: its operands' dtype; float32 at HIGHEST precision on CUDA cores."""
    if lhs_dtype.startswith("f8"):
        return "f8"
    if lhs_dtype == "f32":
        algorithm = re.search(r"algorithm=dot_(\w+?)_", attrs)
        if algorithm:
            return "tf32" if algorithm.group(1).startswith("tf32") else "f32"
        highest = re.search(r"operand_precision=\{highest|\"operand_precision\":\[\"HIGHEST\"", attrs)
        return "f32" if highest else "tf32"
    return lhs_dtype


def _dims(text: Optional[str]) -> List[int]:
    return [int(d) for d in re.findall(r"\d+", text or "")]


def dot_flops(ins: Instr, shapes: Dict[str, str]) -> Tuple[str, float]:
    """``(dtype key, FLOPs)`` of a ``dot`` or a cuBLAS GEMM custom call."""
    lhs = arrays(shapes.get(ins.operands[0], ""))
    if not lhs:
        return "vector", 0.0
    dtype, lhs_dims = lhs[0]
    if ins.op == "dot":
        contracting = _dims(ins.attr("lhs_contracting_dims"))
    else:  # "lhs_contracting_dimensions":["1"] in the custom call's backend config
        m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
        contracting = _dims(m.group(1) if m else "")
    k = math.prod(lhs_dims[d] for d in contracting)
    return _dot_key(dtype, ins.attrs), 2.0 * size(ins.shape) * k


def is_gemm_call(ins: Instr) -> bool:
    target = ins.attr("custom_call_target") or ""
    return ins.op == "custom-call" and ("gemm" in target or "matmul" in target)


def computation_flops(comps: Dict[str, Computation], name: str,
                      cache: Optional[Dict[str, Dict[str, float]]] = None) -> Dict[str, float]:
    """``{dtype key: FLOPs}`` of one pass of computation ``name`` (nested fusions included)."""
    cache = {} if cache is None else cache
    if name in cache:
        return cache[name]
    out: Dict[str, float] = {}
    comp = comps[name]
    for ins in comp.instrs:
        for key, flops in instr_flops(comps, ins, comp.shapes, cache).items():
            out[key] = out.get(key, 0.0) + flops
    cache[name] = out
    return out


def instr_flops(comps: Dict[str, Computation], ins: Instr, shapes: Dict[str, str],
                cache: Optional[Dict[str, Dict[str, float]]] = None) -> Dict[str, float]:
    """``{dtype key: FLOPs}`` of one instruction (a fusion: of its fused computation)."""
    if ins.op == "dot" or is_gemm_call(ins):
        key, flops = dot_flops(ins, shapes)
        return {key: flops}
    if ins.op in ("fusion", "call") and ins.attr("calls" if ins.op == "fusion" else "to_apply") in comps:
        return computation_flops(comps, ins.attr("calls" if ins.op == "fusion" else "to_apply"), cache)
    if ins.op in ("reduce", "reduce-window"):
        return {"vector": float(sum(size(shapes.get(o, "")) for o in ins.operands[: len(ins.operands) // 2]))}
    if ins.op in _NO_FLOPS:
        return {}
    return {"vector": float(size(ins.shape))}


# ---------------------------------------------------------------------------------------------
# Kernels: what the GPU launches
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Kernel:
    name: str
    kind: str  # the opcode; fusions by their kind ("kLoop", "kInput", a GEMM: "gemm"); custom calls by target
    read: float  # bytes of its operands
    write: float  # bytes of its result
    flops: Dict[str, float]
    op_name: str  # the JAX operation it came from (metadata)
    where: str  # the computation that launches it (the entry, a branch, a loop body)
    times: int = 1  # launches per step (a while body's trip count)


def _kind(ins: Instr, comps: Dict[str, Computation]) -> str:
    if ins.op == "custom-call":
        return ins.attr("custom_call_target") or "custom-call"
    if ins.op != "fusion":
        return ins.op
    called = comps.get(ins.attr("calls") or "")
    if "gemm" in ins.attrs and called and any(i.op == "dot" for i in called.instrs):
        return "gemm"
    return ins.attr("kind") or "fusion"


def kernel_of(ins: Instr, comp: Computation, comps: Dict[str, Computation], times: int = 1,
              cache: Optional[Dict[str, Dict[str, float]]] = None) -> Kernel:
    read = sum(shape_bytes(comp.shapes.get(o, "")) for o in ins.operands)
    write = shape_bytes(ins.shape, skip_workspace=ins.op == "custom-call")
    return Kernel(ins.name, _kind(ins, comps), read, write, instr_flops(comps, ins, comp.shapes, cache),
                  ins.op_name, comp.name, times)


@dataclasses.dataclass
class Program:
    """The launches of one step: kernels on the taken path, and each conditional's branches."""

    kernels: List[Kernel]
    conditionals: List[Dict[str, Any]]  # {"name", "branches": [kernel count per branch], "op_name"}
    loops: List[Dict[str, Any]]  # {"name", "trip_count", "kernels_per_trip"}

    @property
    def kernel_count(self) -> int:
        return sum(k.times for k in self.kernels)

    @property
    def kernel_count_min(self) -> int:
        """The count with every conditional's smaller branch instead of its larger one."""
        return self.kernel_count - sum(max(c["branches"]) - min(c["branches"]) for c in self.conditionals)


def _trip_count(ins: Instr) -> int:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
    return int(m.group(1)) if m else 1


def program(comps: Dict[str, Computation], entry: str) -> Program:
    """The kernels the GPU launches for one run of ``entry`` (see the module docstring)."""
    prog = Program([], [], [])
    cache: Dict[str, Dict[str, float]] = {}

    def walk(name: str, times: int, into: List[Kernel]) -> None:
        comp = comps[name]
        for ins in comp.instrs:
            if ins.op in _NO_KERNEL or ins.op.endswith("-done"):
                continue
            if ins.op == "while":
                trips = _trip_count(ins)
                before = len(into)
                walk(ins.attr("body"), times * trips, into)
                walk(ins.attr("condition"), times * (trips + 1), into)
                prog.loops.append({"name": ins.name, "trip_count": trips, "kernels_per_trip": len(into) - before})
            elif ins.op == "conditional":
                branches = _branches(ins)
                found: List[List[Kernel]] = []
                for branch in branches:
                    found.append([])
                    walk(branch, times, found[-1])
                into.extend(max(found, key=lambda ks: sum(k.times for k in ks)))
                prog.conditionals.append({"name": ins.name, "op_name": ins.op_name,
                                          "branches": [sum(k.times for k in ks) for ks in found]})
            elif ins.op == "call" and ins.attr("to_apply") in comps:
                walk(ins.attr("to_apply"), times, into)
            else:
                into.append(kernel_of(ins, comp, comps, times, cache))

    walk(entry, 1, prog.kernels)
    return prog


def _branches(ins: Instr) -> List[str]:
    listed = ins.attr("branch_computations")
    if listed:
        return re.findall(r"%?([\w.\-]+)", listed.strip("{}"))
    return [ins.attr("true_computation"), ins.attr("false_computation")]


# ---------------------------------------------------------------------------------------------
# The time model
# ---------------------------------------------------------------------------------------------

def kernel_time(k: Kernel, device: Dict[str, Any]) -> float:
    """Seconds of one launch of ``k`` without its launch cost: the slower of its memory traffic at
    HBM bandwidth and its FLOPs at the peak of each dtype."""
    compute = sum(flops / device["peaks"][key] for key, flops in k.flops.items())
    return max((k.read + k.write) / device["hbm"], compute)


def model_time(prog: Program, device: Dict[str, Any], launch_s: float) -> Dict[str, float]:
    """``{"total_us", "work_us", "launch_us", "memory_bound_kernels"}`` of one step."""
    work = sum(kernel_time(k, device) * k.times for k in prog.kernels)
    launches = prog.kernel_count + len(prog.conditionals)  # a conditional reads its predicate back
    bound = sum(k.times for k in prog.kernels
                if (k.read + k.write) / device["hbm"] >= kernel_time(k, device))
    return {"total_us": 1e6 * (work + launches * launch_s), "work_us": 1e6 * work,
            "launch_us": 1e6 * launches * launch_s, "memory_bound_kernels": bound}


def summarize(prog: Program) -> Dict[str, Any]:
    """Totals of a program: kernels, bytes, FLOPs by dtype, kernels by kind, the model's times."""
    flops: Dict[str, float] = {}
    kinds: Dict[str, int] = {}
    for k in prog.kernels:
        for key, value in k.flops.items():
            flops[key] = flops.get(key, 0.0) + value * k.times
        kinds[k.kind] = kinds.get(k.kind, 0) + k.times
    times = {f"{dev} {mode}": model_time(prog, spec, launch)
             for dev, spec in DEVICES.items() for mode, launch in LAUNCH_S.items()}
    if flops.get("f32"):  # sensitivity: the same program with its float32 dots at the TF32 peak
        tf32 = {"hbm": DEVICES["H100 SXM"]["hbm"], "peaks": {**_HOPPER_PEAKS, "f32": _HOPPER_PEAKS["tf32"]}}
        times["H100 SXM launch, f32 dots at tf32"] = model_time(prog, tf32, LAUNCH_S["launch"])
    return {"kernels": prog.kernel_count, "kernels_min": prog.kernel_count_min, "kernels_by_kind": kinds,
            "read_bytes": sum(k.read * k.times for k in prog.kernels),
            "write_bytes": sum(k.write * k.times for k in prog.kernels),
            "flops": flops, "conditionals": prog.conditionals, "loops": prog.loops, "model": times}


# ---------------------------------------------------------------------------------------------
# The steps: 2-D Poisson, a Flax tanh MLP, each precision mode
# ---------------------------------------------------------------------------------------------

# mode -> AmpConfig keywords (None: a float32 step without jaxamp's AMP)
MODES: Dict[str, Optional[Dict[str, Any]]] = {
    "fp32_engine": None,  # jaxamp.grad(method="forward"): jaxamp's engine, AMP off, jax.value_and_grad
    "fp32_jax_grad": None,  # the user's nested jax.grad, jax.value_and_grad, optax.adam
    "bf16": {"dtype": "bfloat16"},
    "fp16_plain": {"derivative_scaling": False},
    "fp16_scaler": {},  # AmpConfig(): fp16 + DerivScaler, per order
    # the same with the float32 values stored for the backward pass, not recomputed (as jax.grad keeps them)
    "fp16_stored": {"recompute_float32": False},
    "fp16_per_term": {"mode": "per_term_scaler"},
    # fp16 + DerivScaler with every layer and activation in float16 (the examples' placement, examples/common/config.py)
    "fp16_all16": {"autocast_firstlayer": True, "autocast_activation": True},
    "fp16_per_tensor": {"tensor_scaling": True},
    "fp8": {"dtype": "float8"},
}
DEFAULT_SIZES = "4x128:20000,4x512:6000"
# Modulus Sym's cavity as Modulus runs it (examples/configs/ldc_gpu.yaml, benchmarks/ldc.py's LDCSize):
# 6 x 512 SiLU, 4 000 interior points, 1 000 on the lid and 1 000 on the no-slip walls
DEFAULT_CAVITY_SIZES = "6x512:4000"
PROBLEMS = ("poisson", "cavity")
PROFILE_POINTS = 512  # jaxamp.init profiles this many points (on the CPU) to start the scales


@dataclasses.dataclass(frozen=True)
class Size:
    """Hidden layers, their width and the interior points; the boundary points are a tenth of them
    (Poisson) or a quarter on the lid and a quarter on the no-slip walls (the cavity, as Modulus)."""

    depth: int
    width: int
    points: int
    problem: str = "poisson"

    @property
    def boundary(self) -> int:
        return max(2, self.points // (4 if self.problem == "cavity" else 10))

    @property
    def label(self) -> str:
        return f"{self.depth}x{self.width}:{self.points}"


def parse_sizes(text: str, problem: str = "poisson") -> List[Size]:
    """``"4x128:20000,4x512:6000"``: hidden layers x width : interior points (boundary: :class:`Size`)."""
    out = []
    for item in text.split(","):
        m = re.fullmatch(r"(\d+)x(\d+):(\d+)", item.strip())
        if not m:
            flag = "--cavity-sizes" if problem == "cavity" else "--sizes"
            raise SystemExit(f"{flag}: {item!r} is not DEPTHxWIDTH:POINTS (e.g. 6x512:4000)")
        out.append(Size(*(int(v) for v in m.groups()), problem=problem))
    return out


def _mlp(size: Size):
    import flax.linen as nn
    import jax.numpy as jnp

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, z):
            h = z
            for _ in range(size.depth):
                h = jnp.tanh(nn.Dense(size.width)(h))
            return nn.Dense(1)(h)

    return MLP()


def _poisson_losses(u: Callable, grad: Callable, **grad_kw) -> Callable:
    """Loss terms of ``u_xx + u_yy = f`` on the unit square, u = 0 on the boundary, with ``grad``'s
    nested second derivatives (``grad_kw``: names and method for jaxamp.grad)."""
    import jax
    import jax.numpy as jnp

    named = bool(grad_kw)
    u_xx = grad(grad(u, 1, **({"of": "u", "wrt": "x"} if named else {}), **grad_kw), 1,
                **({"wrt": "x"} if named else {}), **grad_kw)
    u_yy = grad(grad(u, 2, **({"of": "u", "wrt": "y"} if named else {}), **grad_kw), 2,
                **({"wrt": "y"} if named else {}), **grad_kw)

    def losses(params, batch):
        x, y = batch["interior"][:, 0], batch["interior"][:, 1]
        f = -2 * jnp.pi**2 * jnp.sin(jnp.pi * x) * jnp.sin(jnp.pi * y)
        r = jax.vmap(u_xx, (None, 0, 0))(params, x, y) + jax.vmap(u_yy, (None, 0, 0))(params, x, y) - f
        ub = jax.vmap(u, (None, 0, 0))(params, batch["boundary"][:, 0], batch["boundary"][:, 1])
        return {"pde": jnp.mean(r**2), "bc": jnp.mean(ub**2)}

    return losses


def build_step(mode: str, size: Size, seed: int = 0) -> Tuple[Callable, Tuple[Any, ...]]:
    """``(train step, (params, opt_state, batch))`` of ``mode`` at ``size`` (its problem: the Poisson PINN
    or the cavity); values on the CPU."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxamp

    if size.problem == "cavity":
        return _cavity_step(mode, size, seed)
    model = _mlp(size)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    params = model.init(k1, jnp.zeros(2))
    batch = {"interior": jax.random.uniform(k2, (size.points, 2)),
             "boundary": jax.random.uniform(k3, (size.boundary, 2))}
    if MODES[mode] is None:  # float32: jaxamp's engine or the user's jax.grad, a plain optax step
        u = lambda p, x, y: model.apply(p, jnp.stack([x, y]))[0]  # noqa: E731
        grad_kw = {"method": "forward"} if mode == "fp32_engine" else {}
        losses = _poisson_losses(u, jaxamp.grad if grad_kw else jax.grad, **grad_kw)
        return _fp32_step(losses), (params, optax.adam(1e-3).init(params), batch)
    amp = jaxamp.AmpConfig(**MODES[mode])
    net = jaxamp.autocast(model.apply, amp)
    u = lambda p, x, y: net(p, jnp.stack([x, y]))[0]  # noqa: E731
    losses = _poisson_losses(u, jaxamp.grad, method="auto")
    first = jax.tree_util.tree_map(lambda a: a[:PROFILE_POINTS], batch)  # the scales' start: no effect on the program
    amp_state = jaxamp.init(losses, amp)(params, first)  # a float32 profile
    optimizer = jaxamp.optimizer(optax.adam(1e-3), amp_state=amp_state, on_stall=None)
    return _amp_step(losses, optimizer), (params, optimizer.init(params), batch)


def _cavity_losses(model: Any, derive: Callable) -> Callable:
    """The cavity's loss terms (those of ``benchmarks/ldc.py``'s step): continuity and momentum
    residuals from ``derive(params, interior) -> {name: values}`` (the outputs and
    ``ldc.DERIVATIVES``), the lid's and the no-slip walls' velocity mismatch."""
    import jax.numpy as jnp

    from benchmarks import ldc

    def losses(params, batch):
        terms = {k: jnp.mean(r**2) for k, r in ldc.residuals(derive(params, batch["interior"])).items()}
        lid, wall = model.apply(params, batch["lid"]), model.apply(params, batch["noslip"])
        terms["lid"] = jnp.mean((lid[:, 0] - 1.0) ** 2 + lid[:, 1] ** 2)
        terms["noslip"] = jnp.mean(wall[:, 0] ** 2 + wall[:, 1] ** 2)
        return terms

    return losses


def _nested_jax_grad(model: Any) -> Callable:
    """``derive(params, points)`` as a user writes it: per point, each derivative of ``ldc.DERIVATIVES``
    (``u__x__x``) as nested ``jax.grad``s of one output along ``x``/``y``, under ``jax.vmap``."""
    import jax
    import jax.numpy as jnp

    from benchmarks import ldc

    def point(p, x, y):
        return model.apply(p, jnp.stack([x, y]))

    def derivative(name):
        out, *wrt = name.split("__")
        f = lambda p, x, y, i=ldc.OUTPUTS.index(out): point(p, x, y)[i]  # noqa: E731
        for axis in wrt:
            f = jax.grad(f, 1 + ldc.INPUTS.index(axis))
        return f

    fns = {name: derivative(name) for name in ldc.DERIVATIVES}

    def derive(params, points):
        x, y = points[:, 0], points[:, 1]
        values = jax.vmap(point, (None, 0, 0))(params, x, y)
        d = {name: values[:, i] for i, name in enumerate(ldc.OUTPUTS)}
        return {**d, **{name: jax.vmap(f, (None, 0, 0))(params, x, y) for name, f in fns.items()}}

    return derive


def _cavity_step(mode: str, size: Size, seed: int) -> Tuple[Callable, Tuple[Any, ...]]:
    """The lid-driven cavity of ``benchmarks/ldc.py`` (Modulus Sym's, a ``jaxamp.models.FullyConnected``
    SiLU network ``(x, y) -> (u, v, p)``, its derivatives by a ``jaxamp.Derivatives`` engine), in ``mode``:
    float32 with the engine (``method="forward"``, AMP off) or the user's nested ``jax.grad``, each a
    plain optax step; otherwise the network placed by ``FullyConnected.from_amp`` and the step of
    :func:`_amp_step`, as the Poisson steps."""
    import jax
    import optax

    import jaxamp
    from benchmarks import ldc
    from jaxamp.models import FullyConnected

    shape = ldc.LDCSize(nr_layers=size.depth, layer_size=size.width, n_interior=size.points,
                        n_lid=size.boundary, n_noslip=size.boundary)
    params, batch = ldc.init_params(shape, seed), ldc.make_points(shape, seed)
    amp = jaxamp.AmpConfig(enabled=False) if MODES[mode] is None else jaxamp.AmpConfig(**MODES[mode])
    model = FullyConnected.from_amp(amp, out_features=len(ldc.OUTPUTS), layer_size=size.width,
                                    nr_layers=size.depth)
    if mode == "fp32_jax_grad":
        derive = _nested_jax_grad(model)
    else:
        derive = jaxamp.Derivatives(lambda p, x: model.apply(p, x), inputs=ldc.INPUTS, outputs=ldc.OUTPUTS,
                                    derivatives=ldc.DERIVATIVES, amp=amp, method="forward")
    losses = _cavity_losses(model, derive)
    if MODES[mode] is None:
        return _fp32_step(losses), (params, optax.adam(1e-3).init(params), batch)
    first = jax.tree_util.tree_map(lambda a: a[:PROFILE_POINTS], batch)  # the scales' start: no effect on the program
    optimizer = jaxamp.optimizer(optax.adam(1e-3), amp_state=jaxamp.init(losses, amp)(params, first), on_stall=None)
    return _amp_step(losses, optimizer), (params, optimizer.init(params), batch)


def _fp32_step(losses: Callable) -> Callable:
    """A plain float32 step: ``jax.value_and_grad`` of the terms' sum, ``optax.adam(1e-3)``."""
    import jax
    import optax

    optimizer = optax.adam(1e-3)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p, b: sum(losses(p, b).values()))(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _amp_step(losses: Callable, optimizer: Any) -> Callable:
    import jax
    import optax

    import jaxamp

    def step(params, opt_state, batch):
        out = jaxamp.value_and_grad(lambda p, b: sum(losses(p, b).values()))(opt_state, params, batch)
        if len(out) == 3:  # (loss, grads, flags): the flags go to the optimizer
            loss, grads, flags = out
            updates, opt_state = optimizer.update(grads, opt_state, params, flags=flags)
        else:
            loss, grads = out
            updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.numpy.asarray(loss)

    return step


def gpu_target(path: str):
    """The deviceless mesh's replicated sharding for the device description at ``path``."""
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    with open(path) as f:
        topology = topologies.get_topology_desc(platform="cuda", target_config=f.read(), topology="1x1x1")
    mesh = topologies.make_mesh(topology, (1,), ("d",))
    return NamedSharding(mesh, PartitionSpec())


KERNEL_COLUMNS = ("name", "kind", "read_bytes", "write_bytes", "flops", "op_name", "where", "times")


def kernel_rows(prog: Program) -> List[List[Any]]:
    """One row per kernel (:data:`KERNEL_COLUMNS`); op names without the ``jit(step)/`` prefix."""
    return [[k.name, k.kind, int(k.read), int(k.write), {d: int(f) for d, f in k.flops.items()},
             k.op_name.replace("jit(step)/", "")[:80], k.where, k.times] for k in prog.kernels]


def write_json(result: Dict[str, Any], path: str) -> None:
    """``result`` as indented JSON, each kernel row on one line."""
    rows = {}
    for i, row in enumerate(result["rows"]):
        if "per_kernel" in row:
            rows[f"@per_kernel_{i}@"] = row["per_kernel"]
            row = result["rows"][i] = {**row, "per_kernel": f"@per_kernel_{i}@"}
    text = json.dumps(result, indent=1)
    for key, kernels in rows.items():
        lines = ",\n   ".join(json.dumps(k, separators=(",", ":")) for k in kernels)
        text = text.replace(json.dumps(key), "[\n   " + lines + "\n  ]")
    with open(path, "w") as f:
        f.write(text + "\n")
    for i, row in enumerate(result["rows"]):  # back to the rows as returned
        if "per_kernel" in row:
            result["rows"][i] = {**row, "per_kernel": rows[row["per_kernel"]]}


def compile_step(mode: str, size: Size, sharding: Any, reps: int = 0) -> Dict[str, Any]:
    """One step compiled for the GPU target (``sharding``: its deviceless mesh), or with ``sharding``
    None for the local device and, ``reps`` > 0, timed there: its summary, memory and optimized HLO text."""
    import jax

    t0 = time.perf_counter()
    with jax.default_device(jax.devices("cpu")[0] if sharding is not None else jax.devices()[0]):
        step, args = build_step(mode, size)
    if sharding is not None:
        args = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    t1 = time.perf_counter()
    compiled = jax.jit(step).lower(*args).compile()
    t2 = time.perf_counter()
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    comps, entry = parse_module(text)
    prog = program(comps, entry)
    row = {"problem": size.problem, "mode": mode, "size": size.label, "boundary_points": size.boundary,
           **summarize(prog),
           "memory": {k: getattr(mem, f"{k}_size_in_bytes") for k in ("temp", "argument", "output", "alias")},
           "build_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2), "per_kernel": kernel_rows(prog)}
    if reps > 0 and sharding is None:
        row["measured_us"] = time_compiled(compiled, args, reps)
    return {"row": row, "hlo": text}


def time_compiled(compiled: Any, args: Tuple[Any, ...], reps: int) -> Dict[str, float]:
    """``{"median", "min"}`` microseconds of ``reps`` runs of ``compiled(*args)`` each waited for, after one
    warm-up run (the same inputs each time: the step's outputs are not fed back)."""
    import jax

    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t)
    times.sort()
    return {"median": 1e6 * times[len(times) // 2], "min": 1e6 * times[0], "reps": reps}


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=HERE, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _target(target: Optional[str]) -> Dict[str, Any]:
    """What the steps were compiled for: the device description file, or (None) the local device."""
    import jax

    if target is None:
        device = jax.devices()[0]
        return {"file": None, "device": getattr(device, "device_kind", device.platform),
                "note": "compiled for and timed on the local device (--time): measured_us beside the model "
                        "of that device's program"}
    with open(target, "rb") as f:
        raw = f.read()
    described = re.search(r'device_description_str: "([^"]*)"', raw.decode())
    return {"file": os.path.abspath(target), "sha256": hashlib.sha256(raw).hexdigest(),
            "device": described.group(1) if described else "?",
            "note": "compiled for the H100 description only (no H200 description available); the H200 "
                    "rows apply H200 SXM's 4.8 TB/s to the H100 program (same GH100 die)"}


def _header(argv: Sequence[str], target: Optional[str]) -> Dict[str, Any]:
    import jax

    return {
        "command": "python -m benchmarks gpu_program " + " ".join(argv),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "jaxamp_uncommitted": _git("status", "--porcelain", "--", "jaxamp").splitlines(),
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "python": platform.python_version()},
        "target": _target(target),
        "matmul_precision": "highest (jax_default_matmul_precision, every step)",
        "per_kernel_columns": list(KERNEL_COLUMNS),
        "model": {"devices": DEVICES, "launch_s": LAUNCH_S,
                  "rule": "per kernel max(bytes / hbm, sum_dtype flops / peak) + launch per kernel and per "
                          "conditional; bytes: operands + result once each; conditionals: larger branch"},
    }


def table(rows: List[Dict[str, Any]]) -> str:
    """A text table: kernels, temp memory and the model's H100 times per step."""
    lines = [f"{'problem':<8} {'size':<15} {'mode':<16} {'kernels':>7} {'temp MiB':>9} {'arg MiB':>8} {'GB r+w':>7} "
             f"{'H100 us':>8} {'H100 cb us':>10}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r.get('problem', 'poisson'):<8} {r['size']:<15} {r['mode']:<16} error: {r['error'][:80]}")
            continue
        measured = f" {r['measured_us']['median']:>11.1f}" if "measured_us" in r else ""
        lines.append(f"{r.get('problem', 'poisson'):<8} {r['size']:<15} {r['mode']:<16} {r['kernels']:>7} "
                     f"{r['memory']['temp'] / 2**20:>9.1f} "
                     f"{r['memory']['argument'] / 2**20:>8.1f} {(r['read_bytes'] + r['write_bytes']) / 1e9:>7.3f} "
                     f"{r['model']['H100 SXM launch']['total_us']:>8.1f} "
                     f"{r['model']['H100 SXM command_buffer']['total_us']:>10.1f}{measured}")
    if any("measured_us" in r for r in rows):
        lines[0] += f" {'measured us':>11}"
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks gpu_program", description=__doc__.split("\n")[0])
    p.add_argument("--problems", default=",".join(PROBLEMS), help="comma-separated, of: " + ", ".join(PROBLEMS))
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help="the Poisson steps' DEPTHxWIDTH:POINTS[,...] (default %(default)s)")
    p.add_argument("--cavity-sizes", default=DEFAULT_CAVITY_SIZES,
                   help="the cavity's DEPTHxWIDTH:INTERIOR_POINTS[,...], a quarter as many on the lid and on the "
                        "walls each (default %(default)s: Modulus')"),
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    p.add_argument("--target", default=DEFAULT_TARGET, help="the GPU's device description (.txtpb)")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/gpu_program-<commit>-<date>.json)")
    p.add_argument("--hlo-dir", default=None, help="also write each step's optimized GPU HLO there")
    p.add_argument("--time", type=int, default=0, metavar="REPS",
                   help="compile for the local device instead of --target and time each step REPS times "
                        "(on a lent GPU: the measured times beside the model's; benchmarks/gpu.sh)")
    args = p.parse_args(argv)
    if args.time < 0:
        p.error(f"--time: {args.time} is not allowed: expected a number of timed runs >= 1 (0: no timing)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {unknown}; expected some of {list(MODES)}")
    problems = [q.strip() for q in args.problems.split(",") if q.strip()]
    if not problems or any(q not in PROBLEMS for q in problems):
        p.error(f"--problems: {args.problems!r} is not allowed: expected some of {list(PROBLEMS)}, comma-separated")
    sizes = [s for q in problems for s in parse_sizes(args.cavity_sizes if q == "cavity" else args.sizes, q)]
    if not args.time:
        # the plugin's CUDA version check needs a driver, the compile does not (set before JAX starts its backends)
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")  # every step; fp32 at full precision
    sharding = None if args.time else gpu_target(args.target)
    result = _header(argv, None if args.time else args.target)
    result["rows"] = []
    for size in sizes:
        for mode in modes:
            try:
                out = compile_step(mode, size, sharding, reps=args.time)
            except Exception as e:  # a mode that does not compile is a finding, not the end of the run
                result["rows"].append({"problem": size.problem, "mode": mode, "size": size.label,
                                       "error": f"{type(e).__name__}: {e}"[:2000]})
                print(f"{size.problem} {size.label} {mode}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            result["rows"].append(out["row"])
            if args.hlo_dir:
                os.makedirs(args.hlo_dir, exist_ok=True)
                prefix = "" if size.problem == "poisson" else f"{size.problem}-"
                name = f"{prefix}{mode}-{size.label.replace(':', '-')}.hlo"
                with open(os.path.join(args.hlo_dir, name), "w") as f:
                    f.write(out["hlo"])
            print(table([out["row"]]).splitlines()[1], flush=True)
    print(table(result["rows"]))
    name = f"gpu_program-{result['commit'] or 'nocommit'}-{result['date']}.json"
    path = args.out or os.path.join(HERE, "results", name)
    write_json(result, path)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
