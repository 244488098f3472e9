"""Random derivative idioms against JAX's own and the engine's plan of the same derivative set.

    python -m benchmarks idioms --random N --seed S [--amp {off,fp16}] [--no-x64] [--step-time K]
        [--program-timeout S] [--out FILE]

A generator of derivative programs (issue #56, item 2). Each program has

- a random network of the point: a Flax MLP or a plain tanh MLP function (width 8-32, depth
  1-3, 1 or 3 outputs), sometimes under ``jax.checkpoint``;
- a random split of the point's D = 2..4 coordinates into arguments: scalars ``u(p, t, x, y)``,
  one vector ``u(p, z)``, a scalar and a vector ``u(p, t, xy)``, or a dict pytree
  ``u(p, {"t": t, "xy": xy})``;
- 1-4 terms, each a random composition of ``grad`` / ``jacfwd`` / ``jacrev`` / ``hessian`` /
  ``jvp`` / ``laplacian`` over those arguments up to total order 4 (nested ``jacfwd(jacrev(u))``,
  ``hessian(trace(hessian))``, ``laplacian(laplacian)``, a gradient over a scalar argument
  beside a Hessian over a vector one, vector fields' divergence and vector Laplacian, ...), the
  tensors between steps reduced by a trace, an entry or a weighted sum, sometimes times an
  output's value (a nonlinear residual);
- ``jax.vmap`` over 16-64 points.

Each program is written three ways: with jaxamp's transforms (``jaxamp.grad``, ...; a plain
call: AMP off, scale 1 -- or ``--amp fp16``: ``jaxamp.scaled`` under ``AmpConfig()``, the network
autocast), with JAX's own (``jax.grad``, ...; the Laplacian the trace of ``jax.hessian``), and as
the engine's plan of the same derivative set: ``jaxamp.Derivatives`` (method "forward") of every
partial derivative the terms read (lower orders included), the terms summed from its values.

Recorded per program: a description, XLA FLOPs of each form (``cost_analysis()["flops"]`` of the
jitted program) and their ratios (jaxamp / engine, jaxamp / JAX), the same of the gradient step
(``jax.grad`` of the mean squared terms along the parameters: jaxamp / engine, and its trace + lower +
compile seconds against JAX's own step's), trace + lower + compile seconds of each (the first
compile, and again at a new batch shape: ``n_points + 8``), and the values' largest error against
JAX's own (relative to each term's largest magnitude), float32 and (unless ``--no-x64``) float64.
Program ``i`` of seed ``S`` is drawn from ``numpy.random.default_rng([S, i])``:
``describe(generate(S, i))`` reproduces it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

import jax
import jax.numpy as jnp

import jaxamp

COORDS = ("t", "x", "y", "z")


# ----------------------------------------------------------------------------------------------
# Symbolic values: each entry of a term's tensor is a linear combination of partial derivatives.


class Lin:
    """A linear combination of partials: ``{(output, sorted coordinate indices): coefficient}``."""

    __slots__ = ("c",)

    def __init__(self, c: Optional[Dict[Tuple[int, Tuple[int, ...]], float]] = None) -> None:
        self.c = dict(c or {})

    def __add__(self, other: Any) -> "Lin":
        if isinstance(other, (int, float)) and other == 0:
            return self
        out = dict(self.c)
        for k, v in other.c.items():
            out[k] = out.get(k, 0.0) + v
        return Lin(out)

    __radd__ = __add__

    def __mul__(self, a: float) -> "Lin":
        return Lin({k: v * float(a) for k, v in self.c.items()})

    __rmul__ = __mul__

    def d(self, coord: int) -> "Lin":
        return Lin({(o, tuple(sorted(idx + (coord,)))): v for (o, idx), v in self.c.items()})


def _sym_apply(S: np.ndarray, fn: Callable[[Lin], Any]) -> np.ndarray:
    out = np.empty(S.shape, dtype=object)
    for idx in np.ndindex(S.shape):
        out[idx] = fn(S[idx])
    return out


def _sym_jac(S: np.ndarray, coords: Sequence[int]) -> np.ndarray:
    """The symbolic Jacobian: ``S.shape + (len(coords),)`` (no axis for a scalar argument)."""
    cols = [_sym_apply(S, lambda L, c=c: L.d(c)) for c in coords]
    return np.stack(cols, axis=-1)


# ----------------------------------------------------------------------------------------------
# Programs


@dataclass
class Arg:
    kind: str  # "s" scalar, "v" vector, "d" dict {name: scalar or vector}
    coords: Tuple[int, ...]  # the point's coordinates, in the argument's flattened order
    parts: Tuple[Tuple[str, Tuple[int, ...], bool], ...] = ()  # dict: (key, coords, is_scalar), sorted keys

    @property
    def name(self) -> str:
        names = "".join(COORDS[c] for c in self.coords)
        if self.kind == "s":
            return f"{names}:R"
        if self.kind == "v":
            return f"{names}:R{len(self.coords)}"
        inner = ", ".join(f"{k}:" + ("R" if sc else f"R{len(cs)}") for k, cs, sc in self.parts)
        return "{" + inner + "}"


@dataclass
class Op:
    kind: str  # grad jacfwd jacrev hessian laplacian jvp | trace entry wsum
    arg: int = -1  # the argument's index among the inputs (not counting params)
    direction: Optional[np.ndarray] = None  # jvp's tangent (flattened), wsum's weights
    entry: Tuple[int, ...] = ()


@dataclass
class Term:
    output: Optional[int]  # an output's index; None: the vector field of every output
    ops: List[Op]
    times: Optional[int] = None  # multiplied by this output's value


@dataclass
class Program:
    seed: int
    index: int
    D: int
    m: int
    width: int
    depth: int
    flax: bool
    remat: bool
    n_points: int
    args: List[Arg]
    terms: List[Term]
    template: str = "random"
    desc: str = ""
    reads: List[Dict[Tuple[int, Tuple[int, ...]], float]] = field(default_factory=list)


def _arg_shape(arg: Arg) -> Tuple[int, ...]:
    return () if arg.kind == "s" else (len(arg.coords),)


def _layouts(rng: np.random.Generator, D: int) -> List[Arg]:
    kind = rng.choice(["scalars", "vector", "mixed", "dict"], p=[0.25, 0.3, 0.3, 0.15])
    c = tuple(range(D))
    if kind == "scalars":
        return [Arg("s", (i,)) for i in c]
    if kind == "vector":
        return [Arg("v", c)]
    if kind == "mixed":
        return [Arg("s", (0,)), Arg("v", c[1:])]
    rest = c[1:]
    parts = (("t", (0,), True), ("".join(COORDS[i] for i in rest), rest, False))
    return [Arg("d", c, tuple(sorted(parts)))]


def _gen_term(rng: np.random.Generator, prog: Program, max_order: int) -> Term:
    """A random composition: derivative steps over random arguments up to ``max_order``, the
    tensors between them reduced to a scalar where the next step needs one."""
    vector_field = prog.m > 1 and rng.random() < 0.3
    output = None if vector_field else int(rng.integers(prog.m))
    order = int(rng.choice([1, 2, 3, 4], p=[0.2, 0.3, 0.25, 0.25]))
    order = min(order, max_order)
    shape: Tuple[int, ...] = (prog.m,) if vector_field else ()
    ops: List[Op] = []
    left = order
    while left > 0:
        a = int(rng.integers(len(prog.args)))
        arg = prog.args[a]
        kinds = ["jacfwd", "jacrev", "jvp"]
        if shape == ():
            kinds += ["grad", "grad"]
            if left >= 2:
                kinds += ["hessian"] + (["laplacian"] if arg.kind != "d" else [])
        elif rng.random() < 0.4 or len(shape) >= 2:
            ops.append(_reduction(rng, shape))
            shape = ()
            continue
        kind = str(rng.choice(kinds))
        n = len(arg.coords)
        if kind == "jvp":
            ops.append(Op("jvp", a, direction=np.round(rng.uniform(-1, 1, n), 2)))
        else:
            ops.append(Op(kind, a))
        if kind in ("grad", "jacfwd", "jacrev"):
            shape = shape + _arg_shape(arg)
            left -= 1
        elif kind == "hessian":
            shape = _arg_shape(arg) * 2
            left -= 2
        elif kind == "laplacian":
            left -= 2
        else:
            left -= 1
    if shape != ():
        ops.append(_reduction(rng, shape))
    times = int(rng.integers(prog.m)) if rng.random() < 0.3 else None
    return Term(output, ops, times)


def _reduction(rng: np.random.Generator, shape: Tuple[int, ...]) -> Op:
    if len(shape) >= 2 and shape[-1] == shape[-2] and rng.random() < 0.6:
        return Op("trace")  # then a scalar by a weighted sum of what is left, if anything
    if rng.random() < 0.5:
        return Op("entry", entry=tuple(int(rng.integers(s)) for s in shape))
    return Op("wsum", direction=np.round(rng.uniform(-1, 1, int(np.prod(shape))), 2))


def _templates(rng: np.random.Generator, prog: Program) -> Tuple[str, List[Term]]:
    """The forms issue #56 names, on a layout they fit (or None: a random program)."""
    names = ["grad_t_hessian_xy", "jacfwd_jacrev", "biharmonic_hessian", "biharmonic_laplacian",
             "vector_field", "scalar_chain"]
    name = str(rng.choice(names))
    D = prog.D
    if name == "grad_t_hessian_xy":  # u(p, t, xy): u_t, the Hessian over xy, u_tt sometimes
        prog.D = D = max(D, 3)
        prog.args = [Arg("s", (0,)), Arg("v", tuple(range(1, D)))]
        hess = str(rng.choice(["hessian", "jacfwd_jacrev"]))
        ops = [Op("hessian", 1)] if hess == "hessian" else [Op("jacrev", 1), Op("jacfwd", 1)]
        terms = [Term(0, [Op("grad", 0)]), Term(0, ops + [Op("trace")], times=0 if rng.random() < 0.5 else None)]
        if rng.random() < 0.5:
            terms.append(Term(0, [Op("grad", 0), Op("grad", 0)]))
        return name, terms
    if name == "jacfwd_jacrev":  # u(p, z), z = (t, x, y): jacfwd(jacrev(u)) entries / trace
        prog.D = 3
        prog.args = [Arg("v", (0, 1, 2))]
        red = Op("trace") if rng.random() < 0.5 else Op("wsum", direction=np.round(rng.uniform(-1, 1, 9), 2))
        return name, [Term(0, [Op("jacrev", 0), Op("jacfwd", 0), red]),
                      Term(0, [Op("jacrev", 0), Op("entry", entry=(0,))], times=0)]
    if name in ("biharmonic_hessian", "biharmonic_laplacian"):
        prog.D = D = min(D, 3)
        prog.args = [Arg("v", tuple(range(D)))]
        if name == "biharmonic_hessian":
            ops = [Op("hessian", 0), Op("trace"), Op("hessian", 0), Op("trace")]
        else:
            ops = [Op("laplacian", 0), Op("laplacian", 0)]
        return name, [Term(0, ops), Term(0, [])]
    if name == "vector_field":  # u: R3 -> R3, divergence and vector Laplacian
        prog.D = prog.m = 3
        prog.args = [Arg("v", (0, 1, 2))]
        jac = str(rng.choice(["jacfwd", "jacrev"]))
        terms = [Term(None, [Op(jac, 0), Op("trace")])]
        if rng.random() < 0.5:
            terms.append(Term(None, [Op("jacrev", 0), Op("jacfwd", 0), Op("trace"), Op("wsum", direction=np.ones(3))]))
        else:
            terms += [Term(o, [Op("hessian", 0), Op("trace")]) for o in range(3)]
        return name, terms
    # nested scalar jaxamp.grad chains over scalar arguments (the engine-speed form)
    prog.args = [Arg("s", (i,)) for i in range(D)]
    terms = []
    for _ in range(int(rng.integers(1, 4))):
        k = int(rng.integers(1, 5))
        terms.append(Term(int(rng.integers(prog.m)), [Op("grad", int(rng.integers(D))) for _ in range(k)],
                          times=int(rng.integers(prog.m)) if rng.random() < 0.3 else None))
    return name, terms


def generate(seed: int, index: int, max_order: int = 4) -> Program:
    """Program ``index`` of ``seed`` (reproducible: ``numpy.random.default_rng([seed, index])``)."""
    rng = np.random.default_rng([seed, index])
    D = int(rng.integers(2, 5))
    prog = Program(seed=seed, index=index, D=D, m=int(rng.choice([1, 3], p=[0.7, 0.3])),
                   width=int(rng.choice([8, 16, 24, 32])), depth=int(rng.integers(1, 4)),
                   flax=bool(rng.random() < 0.5), remat=bool(rng.random() < 0.2),
                   n_points=int(rng.choice([16, 32, 64])), args=[], terms=[])
    if rng.random() < 0.4:
        prog.template, prog.terms = _templates(rng, prog)
    else:
        prog.args = _layouts(rng, D)
        prog.terms = [_gen_term(rng, prog, max_order) for _ in range(int(rng.integers(1, 5)))]
    prog.reads = [_symbolic(prog, t) for t in prog.terms]
    prog.desc = describe(prog)
    return prog


def generate_many(seed: int, n: int) -> List[Program]:
    return [generate(seed, i) for i in range(n)]


# ----------------------------------------------------------------------------------------------
# Symbolic reads and descriptions


def _symbolic(prog: Program, term: Term) -> Dict[Tuple[int, Tuple[int, ...]], float]:
    if term.output is None:
        S = np.empty((prog.m,), dtype=object)
        for o in range(prog.m):
            S[o] = Lin({(o, ()): 1.0})
    else:
        S = np.empty((), dtype=object)
        S[()] = Lin({(term.output, ()): 1.0})
    for op in term.ops:
        S = _sym_op(prog, S, op)
    value = S[()] if S.shape == () else S
    assert isinstance(value, Lin), (prog.desc, term)
    return value.c


def _sym_op(prog: Program, S: np.ndarray, op: Op) -> np.ndarray:
    if op.kind == "trace":
        return _trace_last(S)
    if op.kind == "entry":
        out = np.empty((), dtype=object)
        out[()] = S[op.entry]
        return out
    if op.kind == "wsum":
        out = np.empty((), dtype=object)
        out[()] = sum(L * w for L, w in zip(S.reshape(-1), op.direction))
        return out
    arg = prog.args[op.arg]
    coords = arg.coords
    if op.kind in ("grad", "jacfwd", "jacrev"):
        J = _sym_jac(S, coords)
        return J if arg.kind != "s" else J[..., 0]
    if op.kind == "hessian":
        H = _sym_jac(_sym_jac(S, coords), coords)
        return H if arg.kind != "s" else H[..., 0, 0]
    if op.kind == "laplacian":
        return _sym_apply(S, lambda L: sum(L.d(c).d(c) for c in coords))
    if op.kind == "jvp":
        return _sym_apply(S, lambda L: sum(L.d(c) * w for c, w in zip(coords, op.direction)))
    raise ValueError(op.kind)


def _trace_last(S: np.ndarray) -> np.ndarray:
    n = S.shape[-1]
    out = np.empty(S.shape[:-2], dtype=object)
    for idx in np.ndindex(out.shape):
        out[idx] = sum(S[idx + (i, i)] for i in range(n))
    return out


def _op_desc(prog: Program, inner: str, op: Op) -> str:
    if op.kind == "trace":
        return f"trace({inner})"
    if op.kind == "entry":
        return f"{inner}[{','.join(map(str, op.entry))}]"
    if op.kind == "wsum":
        return f"wsum({inner})"
    arg = prog.args[op.arg]
    if op.kind == "jvp":
        return f"jvp({inner}, {arg.name})"
    return f"{op.kind}({inner}, {1 + op.arg}:{arg.name})"


def term_desc(prog: Program, term: Term) -> str:
    s = "U" if term.output is None else f"u{term.output}"
    for op in term.ops:
        s = _op_desc(prog, s, op)
    return s + (f" * u{term.times}" if term.times is not None else "")


def describe(prog: Program) -> str:
    net = f"{'flax' if prog.flax else 'tanh'} MLP width {prog.width} depth {prog.depth} -> R{prog.m}"
    net += ", jax.checkpoint" if prog.remat else ""
    args = ", ".join(a.name for a in prog.args)
    terms = " + ".join(term_desc(prog, t) for t in prog.terms)
    return f"u(p, {args}); {terms}; vmap {prog.n_points} points; {net} [{prog.template}]"


def order_of(prog: Program) -> int:
    return max((len(idx) for r in prog.reads for (_, idx) in r), default=0)


# ----------------------------------------------------------------------------------------------
# Networks and the three forms


def _network(prog: Program) -> Tuple[Callable, Any]:
    """``(net(params, z) -> f32[m], params)`` for the flat point ``z`` (``f32[D]``)."""
    key = jax.random.PRNGKey(prog.seed * 1000 + prog.index)
    if prog.flax:
        import flax.linen as nn

        width, depth, m = prog.width, prog.depth, prog.m

        class MLP(nn.Module):
            @nn.compact
            def __call__(self, z):
                h = z
                for _ in range(depth):
                    h = jnp.tanh(nn.Dense(width)(h))
                return nn.Dense(m)(h)

        model = MLP()
        params = model.init(key, jnp.zeros(prog.D))
        net = model.apply
    else:
        sizes = [prog.D] + [prog.width] * prog.depth + [prog.m]
        keys = jax.random.split(key, len(sizes) - 1)
        params = [(jax.random.normal(k, (a, b)) / np.sqrt(a), 0.1 * jax.random.normal(k, (b,)))
                  for k, a, b in zip(keys, sizes[:-1], sizes[1:])]

        def net(params, z):
            h = z
            for W, b in params[:-1]:
                h = jnp.tanh(h @ W + b)
            W, b = params[-1]
            return h @ W + b

    return (jax.checkpoint(net) if prog.remat else net), params


def _pack(prog: Program, args: Sequence[Any]) -> jax.Array:
    """The flat point from the arguments (coordinates in order)."""
    cols: Dict[int, Any] = {}
    for arg, v in zip(prog.args, args):
        if arg.kind == "s":
            cols[arg.coords[0]] = v
        elif arg.kind == "v":
            for j, c in enumerate(arg.coords):
                cols[c] = v[j]
        else:
            for k, cs, sc in arg.parts:
                if sc:
                    cols[cs[0]] = v[k]
                else:
                    for j, c in enumerate(cs):
                        cols[c] = v[k][j]
    return jnp.stack([cols[c] for c in range(prog.D)])


def _unpack(prog: Program, z: jax.Array) -> Tuple[Any, ...]:
    out = []
    for arg in prog.args:
        if arg.kind == "s":
            out.append(z[arg.coords[0]])
        elif arg.kind == "v":
            out.append(z[jnp.array(arg.coords)])
        else:
            out.append({k: (z[cs[0]] if sc else z[jnp.array(cs)]) for k, cs, sc in arg.parts})
    return tuple(out)


def _ravel(arg: Arg, r: Any, prefix: Tuple[int, ...]) -> jax.Array:
    """A derivative over a dict argument (leaves of shape ``prefix + leaf``) as ``prefix + (n,)``."""
    if arg.kind != "d":
        return r
    return jnp.concatenate([jnp.reshape(r[k], prefix + (len(cs),)) for k, cs, _ in arg.parts], axis=-1)


def _ravel_hessian(arg: Arg, r: Any) -> jax.Array:
    if arg.kind != "d":
        return r
    rows = [jnp.reshape(_ravel(arg, r[k], () if sc else (len(cs),)), (len(cs), -1)) for k, cs, sc in arg.parts]
    return jnp.concatenate(rows, axis=0)


def _substitute(args: Tuple[Any, ...], i: int, v: Any) -> Tuple[Any, ...]:
    return args[:i] + (v,) + args[i + 1:]


def _tangent(arg: Arg, w: np.ndarray, dtype) -> Any:
    if arg.kind == "s":
        return jnp.asarray(w[0], dtype)
    if arg.kind == "v":
        return jnp.asarray(w, dtype)
    out, j = {}, 0
    for k, cs, sc in arg.parts:
        out[k] = jnp.asarray(w[j], dtype) if sc else jnp.asarray(w[j:j + len(cs)], dtype)
        j += len(cs)
    return out


def _realize(prog: Program, lib: str, net: Callable, term: Term) -> Callable:
    """The term as ``f(p, *args) -> scalar`` written with ``lib``'s transforms ("jaxamp" or "jax")."""
    L = jaxamp if lib == "jaxamp" else jax

    def base(p, *args):
        y = net(p, _pack(prog, args))
        return y if term.output is None else y[term.output]

    f = base
    for op in term.ops:
        f = _realize_op(prog, lib, L, f, op)
    return f


def _realize_op(prog: Program, lib: str, L: Any, f: Callable, op: Op) -> Callable:
    if op.kind == "trace":
        return lambda *a: jnp.trace(f(*a), axis1=-2, axis2=-1)
    if op.kind == "entry":
        return lambda *a: f(*a)[op.entry]
    if op.kind == "wsum":
        def ws(*a, w=op.direction):
            v = f(*a)
            return jnp.reshape(v, (-1,)) @ jnp.asarray(w, v.dtype)

        return ws
    arg = prog.args[op.arg]
    n = 1 + op.arg  # argnums: params first

    if op.kind in ("grad", "jacfwd", "jacrev"):
        g = getattr(L, op.kind)(f, n)

        def d(*a):
            r = g(*a)
            if arg.kind != "d":
                return r
            k, cs, sc = next(part for part in arg.parts if part[2])  # a scalar leaf: shape = the prefix
            return _ravel(arg, r, jnp.shape(r[k]))

        return d
    if op.kind == "hessian":
        h = L.hessian(f, n)
        return lambda *a: _ravel_hessian(arg, h(*a))
    if op.kind == "laplacian":
        if lib == "jaxamp":
            return jaxamp.laplacian(f, n)
        h = jax.hessian(f, n)
        return lambda *a: jnp.trace(h(*a)) if arg.kind == "v" else h(*a)
    if op.kind == "jvp":
        def jv(*a):
            x = a[n]
            t = _tangent(arg, op.direction, jnp.result_type(jax.tree_util.tree_leaves(x)[0]))
            return L.jvp(lambda v: f(*_substitute(a, n, v)), (x,), (t,))[1]

        return jv
    raise ValueError(op.kind)


def terms_fn(prog: Program, lib: str, net: Callable) -> Callable:
    """``fn(params, Z) -> [N, n_terms]`` written with ``lib``'s transforms, vmapped over points."""
    fs = [_realize(prog, lib, net, t) for t in prog.terms]

    def point(p, z):
        args = _unpack(prog, z)
        y = net(p, _pack(prog, args))  # the value factor as the terms' u computes it
        vals = []
        for t, f in zip(prog.terms, fs):
            v = f(p, *args)
            vals.append(v * y[t.times] if t.times is not None else v)
        return jnp.stack(vals)

    return jax.vmap(point, (None, 0))


def engine_names(prog: Program) -> List[str]:
    names = set()
    for r in prog.reads:
        for (o, idx) in r:
            if idx:
                names.add("__".join((f"u{o}",) + tuple(COORDS[c] for c in idx)))
    return sorted(names)


def chain_names(prog: Program) -> Optional[List[str]]:
    """Where every term is a nest of ``grad`` over scalar arguments of one output: the names of
    the chains' steps in the program's order (``grad(grad(u, x), t)``: ``u0__x``, ``u0__x__t``),
    the engine's plan of the same paths; else None."""
    names = set()
    for t in prog.terms:
        if t.output is None or any(op.kind != "grad" or prog.args[op.arg].kind != "s" for op in t.ops):
            return None
        path = [f"u{t.output}"]
        for op in t.ops:
            path.append(COORDS[prog.args[op.arg].coords[0]])
            names.add("__".join(path))
    return sorted(names)


def engine_fn(prog: Program, net: Callable, amp: Optional[jaxamp.AmpConfig] = None,
              names: Optional[Sequence[str]] = None) -> Callable:
    """The engine's plan of the terms' derivative set (``names``: default every partial the terms
    read, each named by its sorted coordinates), the terms summed from its values."""
    outputs = tuple(f"u{o}" for o in range(prog.m))
    names = list(names or engine_names(prog) or [outputs[0]])
    fn = net if amp is None else jaxamp.autocast(net, amp)
    eng = jaxamp.Derivatives(fn, inputs=COORDS[:prog.D], outputs=outputs, derivatives=names, amp=amp)

    def combine(values):
        cols = []
        for t, r in zip(prog.terms, prog.reads):
            v = sum(c * values[_name_of(o, idx, values)] for (o, idx), c in r.items())
            cols.append(v * values[f"u{t.times}"] if t.times is not None else v)
        return jnp.stack(cols, axis=-1)

    if amp is None:
        return lambda p, Z: combine(eng(p, Z))
    scales = {k: jnp.float32(1.0) for k in eng.scaler_keys}
    return lambda p, Z: combine(jaxamp.scaled(eng)(scales, p, Z)[0])


def _name_of(o: int, idx: Tuple[int, ...], values: Dict[str, Any]) -> str:
    """The engine's name of the partial ``(o, idx)`` among ``values`` (in any order of its steps)."""
    name = "__".join((f"u{o}",) + tuple(COORDS[i] for i in idx))
    if name in values:
        return name
    for k in values:
        parts = k.split("__")
        if parts[0] == f"u{o}" and sorted(parts[1:]) == sorted(COORDS[i] for i in idx):
            return k
    raise KeyError(name)


def _amp_wrap(fn: Callable, amp: Optional[jaxamp.AmpConfig]) -> Callable:
    if amp is None:
        return fn
    scales = {str(k): jnp.float32(1.0) for k in range(1, 5)}
    return lambda p, Z: jaxamp.scaled(fn, amp)(scales, p, Z)[0]


def points(prog: Program, dtype=jnp.float32) -> jax.Array:
    key = jax.random.PRNGKey(prog.seed * 7919 + prog.index)
    return jax.random.uniform(key, (prog.n_points, prog.D), minval=-1.0, maxval=1.0).astype(dtype)


def _compile(fn: Callable, *args) -> Tuple[Any, float]:
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - start


def _flops(compiled) -> Optional[float]:
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    f = (ca or {}).get("flops")
    return float(f) if f is not None else None


def max_error(got: np.ndarray, want: np.ndarray) -> float:
    """The largest error, relative to each term's largest magnitude over the points (floor 1e-3)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)) and np.all(np.isfinite(want)):
        return float("inf")
    scale = np.maximum(np.max(np.abs(want), axis=0), 1e-3)
    return float(np.max(np.abs(got - want) / scale))


def values_check(prog: Program, dtype=jnp.float32, entry: bool = False) -> Dict[str, Any]:
    """Run the jaxamp form (a plain call, scale 1; ``entry``: through ``jaxamp.scaled`` under
    ``AmpConfig()`` at scale 1, its program passes and one plan per point, the network left in
    ``dtype``) and JAX's own in ``dtype``; their max error."""
    net, params = _network(prog)
    params = jax.tree_util.tree_map(lambda a: a.astype(dtype), params)
    Z = points(prog, dtype)
    form = terms_fn(prog, "jaxamp", net)
    mine = np.asarray(jax.jit(_amp_wrap(form, jaxamp.AmpConfig()) if entry else form)(params, Z))
    want = np.asarray(jax.jit(terms_fn(prog, "jax", net))(params, Z))
    return {"error": max_error(mine, want), "dtype": str(np.dtype(mine.dtype)), "mine": mine, "want": want}


def measure(prog: Program, amp_mode: str = "off", progress: Optional[Callable[[Dict[str, Any]], None]] = None
            ) -> Dict[str, Any]:
    """FLOPs, compile seconds and float32 values of the three forms of ``prog``; ``progress``
    (the row so far, its ``phase`` the one starting) called before each phase, so that a run
    stopped in one keeps what the earlier ones measured."""
    amp = jaxamp.AmpConfig() if amp_mode == "fp16" else None
    net, params = _network(prog)
    Z = points(prog)
    forms = {
        "jaxamp": _amp_wrap(terms_fn(prog, "jaxamp", net if amp is None else jaxamp.autocast(net, amp)), amp),
        "jax": terms_fn(prog, "jax", net),
        "engine": engine_fn(prog, net, amp),
    }
    if chain_names(prog) is not None:  # nests of scalar grad: also the engine along the same paths
        forms["engine_paths"] = engine_fn(prog, net, amp, chain_names(prog))
    row: Dict[str, Any] = {"flops": {}, "compile_s": {}}
    out = {}

    def phase(name: str) -> None:
        row["phase"] = name
        if progress is not None:
            progress(dict(row))

    phase("forms")
    # compiled in turn, the order reversed on odd programs: a compile's one-time costs (caches
    # JAX fills on first use) fall on each form alike
    for name, fn in (list(forms.items()) if prog.index % 2 == 0 else list(reversed(forms.items()))):
        compiled, secs = _compile(fn, params, Z)
        row["flops"][name] = _flops(compiled)
        row["compile_s"][name] = round(secs, 3)
        out[name] = np.asarray(compiled(params, Z))
    fl = row["flops"]
    row["flops_over_engine"] = round(fl["jaxamp"] / fl["engine"], 4) if fl["engine"] else None
    row["flops_over_jax"] = round(fl["jaxamp"] / fl["jax"], 4) if fl["jax"] else None
    row["engine_over_jax"] = round(fl["engine"] / fl["jax"], 4) if fl["jax"] else None
    row["compile_over_jax"] = round(row["compile_s"]["jaxamp"] / row["compile_s"]["jax"], 3)
    row["compile_over_engine"] = round(row["compile_s"]["jaxamp"] / row["compile_s"]["engine"], 3)
    if "engine_paths" in fl:
        row["flops_over_engine_paths"] = round(fl["jaxamp"] / fl["engine_paths"], 4)
    # the gradient step the forms are trained with (jax.grad of the mean squared terms): its
    # backward pass differentiates the program as written, which XLA's merging of repeated work
    # in the forward program does not reach
    row["step_flops"], row["step_compile_s"] = {}, {}
    for name in ("jaxamp", "engine", "jax"):
        phase(f"gradient step of {name}")
        step = jax.grad(lambda p, Z, fn=forms[name]: jnp.mean(fn(p, Z) ** 2))
        compiled, secs = _compile(step, params, Z)
        row["step_flops"][name], row["step_compile_s"][name] = _flops(compiled), round(secs, 3)
    sf = row["step_flops"]
    row["step_flops_over_engine"] = round(sf["jaxamp"] / sf["engine"], 4) if sf["engine"] else None
    row["step_compile_over_jax"] = round(row["step_compile_s"]["jaxamp"] / row["step_compile_s"]["jax"], 3)
    # a new batch shape (the points a training run's next shape brings): each form compiled again
    # at ``n_points + 8``, every one-time cost of the first compile (JAX's and jaxamp's) paid
    Z2 = jax.random.uniform(jax.random.PRNGKey(prog.seed + prog.index), (prog.n_points + 8, prog.D), minval=-1.0,
                            maxval=1.0)
    row["compile_new_shape_s"] = {}
    phase("new shape")
    for name, fn in (list(forms.items()) if prog.index % 2 == 1 else list(reversed(forms.items()))):
        row["compile_new_shape_s"][name] = round(_compile(fn, params, Z2)[1], 3)
    new_shape = row["compile_new_shape_s"]
    row["compile_new_shape_over_jax"] = round(new_shape["jaxamp"] / new_shape["jax"], 3)
    del row["phase"]
    row["error_f32"] = max_error(out["jaxamp"], out["jax"]) if amp is None else None
    row["engine_error_f32"] = max_error(out["engine"], out["jax"]) if amp is None else None
    return row


def step_times(prog: Program, amp_mode: str = "off", samples: int = 15, target_s: float = 0.02) -> Dict[str, Any]:
    """Median seconds of one gradient step (``jax.grad`` of the mean squared terms along the
    parameters) of the jaxamp form and of the engine's plan, timed interleaved: each sample runs
    each form's compiled step ``n`` times back to back (``n`` so that a sample lasts about
    ``target_s``), alternating which goes first."""
    amp = jaxamp.AmpConfig() if amp_mode == "fp16" else None
    net, params = _network(prog)
    Z = points(prog)
    forms = {
        "jaxamp": _amp_wrap(terms_fn(prog, "jaxamp", net if amp is None else jaxamp.autocast(net, amp)), amp),
        "engine": engine_fn(prog, net, amp),
    }
    steps = {name: jax.jit(jax.grad(lambda p, Z, fn=fn: jnp.mean(fn(p, Z) ** 2))) for name, fn in forms.items()}
    for step in steps.values():
        jax.block_until_ready(step(params, Z))
    start = time.perf_counter()
    jax.block_until_ready(steps["engine"](params, Z))
    n = max(1, int(target_s / max(time.perf_counter() - start, 1e-6)))
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for k in range(samples):
        for name in (("jaxamp", "engine") if k % 2 == 0 else ("engine", "jaxamp")):
            start = time.perf_counter()
            for _ in range(n):
                out = steps[name](params, Z)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / n)
    med = {name: float(np.median(t)) for name, t in times.items()}
    return {"step_s": med, "step_over_engine": round(med["jaxamp"] / med["engine"], 4), "calls_per_sample": n}


def _x64_errors(seed: int, indices: Sequence[int]) -> Dict[int, Any]:
    """float64 values errors of programs ``indices`` of ``seed`` (run in this process under x64)."""
    errors: Dict[int, Any] = {}
    with jax.enable_x64(True):
        for i in indices:
            try:
                errors[i] = values_check(generate(seed, i), jnp.float64)["error"]
            except Exception as e:  # noqa: BLE001 -- recorded, the run goes on
                errors[i] = f"{type(e).__name__}: {e}"[:500]
    return errors


def program_row(seed: int, i: int, amp_mode: str = "off", x64: bool = True, timed: bool = False,
                progress: Optional[Callable[[Dict[str, Any]], None]] = None) -> Dict[str, Any]:
    """Program ``i`` of ``seed`` measured (:func:`measure`; ``x64``: its float64 values too; ``timed``:
    its gradient step timed): one row of the results, a failure recorded in it beside what the
    phases before it measured; ``progress``: as :func:`measure`'s, with the whole row."""
    prog = generate(seed, i)
    row: Dict[str, Any] = {"index": i, "program": prog.desc, "template": prog.template, "order": order_of(prog),
                           "engine_derivatives": engine_names(prog)}

    def keep(partial: Dict[str, Any]) -> None:
        row.update(partial)
        if progress is not None:
            progress(dict(row))

    try:
        row.update(measure(prog, amp_mode, keep))
    except Exception as e:  # noqa: BLE001 -- a failing form is a finding, recorded
        row["failure"] = f"{type(e).__name__}: {e}"[:2000]
        row["traceback"] = traceback.format_exc()[-3000:]
    if x64:
        keep({"phase": "float64 values"})
        row["error_f64"] = _x64_errors(seed, [i])[i]
    if timed and "failure" not in row:
        keep({"phase": "step times"})
        row.update(step_times(prog, amp_mode))
    if "failure" not in row:
        row.pop("phase", None)
    return row


def _child(queue, *args) -> None:
    queue.put(("done", program_row(*args, progress=lambda row: queue.put(("partial", row)))))


def _in_process(seed: int, i: int, amp_mode: str, x64: bool, timed: bool, timeout_s: float) -> Dict[str, Any]:
    """:func:`program_row` in a process of its own, stopped after ``timeout_s`` seconds: then the
    row of what the phases before the one running measured (the forms' FLOPs when the gradient
    step's compile runs away), marked a timeout in that phase."""
    import multiprocessing
    import queue as queues

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, seed, i, amp_mode, x64, timed), daemon=True)
    start = time.perf_counter()
    proc.start()
    prog = generate(seed, i)
    last: Dict[str, Any] = {"index": i, "program": prog.desc, "template": prog.template, "order": order_of(prog),
                            "engine_derivatives": engine_names(prog), "phase": "start"}
    try:
        while time.perf_counter() - start < timeout_s:
            try:
                kind, row = queue.get(timeout=max(0.01, timeout_s - (time.perf_counter() - start)))
            except queues.Empty:
                break
            if kind == "done":
                return row
            last = row
        return {**last, "timeout": True, "failure": f"over --program-timeout={timeout_s:g} s "
                f"({time.perf_counter() - start:.0f} s) in phase {last.get('phase')!r}"}
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random", type=int, required=True, help="number of programs")
    ap.add_argument("--seed", type=int, default=None, help="default: a fresh one (printed)")
    ap.add_argument("--amp", choices=("off", "fp16"), default="off",
                    help="off: plain calls (scale 1, float32) against the engine with amp=None; fp16: "
                         "jaxamp.scaled under AmpConfig() against the engine under it")
    ap.add_argument("--no-x64", action="store_true", help="skip the float64 values check")
    ap.add_argument("--budget-s", type=float, default=None, help="stop generating after this many seconds")
    ap.add_argument("--step-time", type=int, default=0, metavar="K",
                    help="also time the gradient step of K programs spread over the run against the engine's "
                         "(interleaved medians)")
    ap.add_argument("--program-timeout", type=float, default=None, metavar="S",
                    help="measure each program in a process of its own, stopped after S seconds (recorded as a "
                         "timeout with its description: a program whose compile runs away does not stall the run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.random < 1:
        ap.error(f"--random={args.random} must be >= 1")
    if args.program_timeout is not None and args.program_timeout <= 0:
        ap.error(f"--program-timeout={args.program_timeout} must be > 0 seconds")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(3), "little")
    commit = _commit()
    out = args.out or f"benchmarks/results/idioms-random-{commit}-{seed}-{datetime.date.today()}.json"
    print(f"idioms --random {args.random} --seed {seed} (amp {args.amp})", flush=True)
    start = time.perf_counter()
    rows = []
    for i in range(args.random):
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            print(f"budget reached after {i} programs", flush=True)
            break
        prog = generate(seed, i)
        timed = bool(args.step_time) and i % max(1, args.random // args.step_time) == 0
        if args.program_timeout is None:
            row = program_row(seed, i, args.amp, not args.no_x64, timed)
        else:
            row = _in_process(seed, i, args.amp, not args.no_x64, timed, args.program_timeout)
        rows.append(row)
        print(f"[{i}] {row.get('flops_over_engine')}x engine, {row.get('flops_over_jax')}x jax, "
              f"err {row.get('error_f32')} / {row.get('error_f64')}, compile {row.get('compile_over_jax')}x jax"
              + (f", step {row['step_over_engine']}x engine" if "step_over_engine" in row else "") + ": "
              f"{prog.desc}" + (f"  FAILED {row['failure'][:200]}" if "failure" in row else ""), flush=True)
        if out and (i % 10 == 9):  # the results so far, should the run be cut short
            _write(out, _result(args, argv, commit, seed, start, rows))
    result = _result(args, argv, commit, seed, start, rows)
    print_summary(result["summary"])
    if out:
        _write(out, result)
        print("wrote", out)
    return result


def _result(args, argv, commit: str, seed: int, start: float, rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    return {
        "benchmark": "idioms-random",
        "command": "python -m benchmarks idioms " + " ".join(sys.argv[2:] if argv is None else argv),
        "commit": commit, "seed": seed, "jax": jax.__version__, "date": datetime.datetime.utcnow().isoformat() + "Z",
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
                    "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind},
        "config": {**vars(args), "seed": seed}, "wall_s": round(time.perf_counter() - start, 1),
        "summary": summarize(rows), "programs": rows,
    }


def _write(out: str, result: Dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=float)


def _quantiles(xs: Sequence[float]) -> Dict[str, float]:
    if not xs:
        return {}
    a = np.asarray(xs)
    return {q: round(float(np.quantile(a, v)), 3) for q, v in
            (("min", 0), ("p10", 0.1), ("median", 0.5), ("p90", 0.9), ("max", 1))}


def summarize(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    ok = [r for r in rows if "failure" not in r and r.get("flops_over_engine") is not None]
    # the forms' FLOPs and compile times also of programs stopped or failed in a later phase
    forms = [r for r in rows if r.get("flops_over_engine") is not None]
    steps = [r for r in rows if r.get("step_flops_over_engine") is not None]
    over = [r["flops_over_engine"] for r in forms]
    worst = sorted(forms, key=lambda r: -r["flops_over_engine"])[:10]
    tol = {"f32": 1e-3, "f64": 1e-9}
    mism = [r["index"] for r in rows if isinstance(r.get("error_f32"), float) and not r["error_f32"] <= tol["f32"]]
    mism64 = [r["index"] for r in rows if "error_f64" in r and not (isinstance(r["error_f64"], float)
                                                                    and r["error_f64"] <= tol["f64"])]
    chains = [r for r in forms if "flops_over_engine_paths" in r]
    by_template: Dict[str, List[float]] = {}
    for r in forms:
        by_template.setdefault(r["template"], []).append(r["flops_over_engine"])
    return {
        "programs": len(rows), "measured": len(forms), "measured_every_phase": len(ok),
        "failures": [r["index"] for r in rows if "failure" in r],
        "within_1_05_of_engine": sum(x <= 1.05 for x in over),
        "flops_over_engine": _quantiles(over),
        "flops_over_jax": _quantiles([r["flops_over_jax"] for r in forms]),
        "step_measured": len(steps),
        "step_flops_within_1_05_of_engine": sum(r["step_flops_over_engine"] <= 1.05 for r in steps),
        "step_flops_over_engine": _quantiles([r["step_flops_over_engine"] for r in steps]),
        "engine_over_jax": _quantiles([r["engine_over_jax"] for r in forms]),
        "compile_over_jax": _quantiles([r["compile_over_jax"] for r in forms]),
        "compile_over_engine": _quantiles([r["compile_over_engine"] for r in forms]),
        "compile_new_shape_over_jax": _quantiles([r["compile_new_shape_over_jax"] for r in ok]),
        "step_compile_over_jax": _quantiles([r["step_compile_over_jax"] for r in ok if "step_compile_over_jax" in r]),
        "timeouts": [r["index"] for r in rows if r.get("timeout")],
        "timeout_phases": {str(r["index"]): r.get("phase") for r in rows if r.get("timeout")},
        "chain_programs_within_1_05_of_engine_paths": [sum(r["flops_over_engine_paths"] <= 1.05 for r in chains),
                                                       len(chains)],
        "flops_over_engine_paths": _quantiles([r["flops_over_engine_paths"] for r in chains]),
        "flops_over_engine_by_template": {k: _quantiles(v) | {"n": len(v)} for k, v in sorted(by_template.items())},
        "step_over_engine": _quantiles([r["step_over_engine"] for r in ok if "step_over_engine" in r]) | {
            "n": sum("step_over_engine" in r for r in ok),
            "within_1_10": sum(r["step_over_engine"] <= 1.10 for r in ok if "step_over_engine" in r)},
        "value_tolerance": tol,
        "value_mismatches_f32": mism, "value_mismatches_f64": mism64,
        "worst10_step": [{"index": r["index"], "step_flops_over_engine": r["step_flops_over_engine"],
                          "program": r["program"]}
                         for r in sorted(steps, key=lambda r: -r["step_flops_over_engine"])[:10]],
        "worst10": [{"index": r["index"], "flops_over_engine": r["flops_over_engine"],
                     "flops_over_jax": r["flops_over_jax"], "program": r["program"]} for r in worst],
    }


def print_summary(s: Dict[str, Any]) -> None:
    print(f"\n{s['within_1_05_of_engine']}/{s['measured']} programs at <= 1.05x the engine's FLOPs "
          f"({len(s['failures'])} failed: {s['failures']}; over the time limit: {s['timeouts']})")
    print(f"  gradient step: {s['step_flops_within_1_05_of_engine']}/{s['step_measured']} at <= 1.05x the "
          "engine's FLOPs")
    for k in ("flops_over_engine", "step_flops_over_engine", "flops_over_jax", "engine_over_jax", "compile_over_jax",
              "compile_over_engine", "compile_new_shape_over_jax", "step_compile_over_jax", "step_over_engine"):
        print(f"  {k}: {s[k]}")
    print(f"  scalar grad chains: {s['chain_programs_within_1_05_of_engine_paths']} within 1.05x the engine along "
          f"the same paths: {s['flops_over_engine_paths']}")
    for k, v in s["flops_over_engine_by_template"].items():
        print(f"  [{k}] flops/engine {v}")
    print(f"  value mismatches: float32 {s['value_mismatches_f32']}, float64 {s['value_mismatches_f64']}")
    print("  worst 10 (FLOPs / engine):")
    for w in s["worst10_step"]:
        print(f"    step {w['step_flops_over_engine']:7.3f}x engine  #{w['index']}: {w['program']}")
    for w in s["worst10"]:
        print(f"    {w['flops_over_engine']:7.3f}x engine {w['flops_over_jax']:7.3f}x jax  #{w['index']}: "
              f"{w['program']}")


if __name__ == "__main__":
    main()
