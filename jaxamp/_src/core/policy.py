"""The AMP policy in the traced program, so that a config is declared once.

:func:`jaxamp.autocast` marks its network's output with :data:`policy_p`, an identity primitive
whose static ``policy`` is the autocast config's :class:`Policy` (it lowers to nothing and passes
through ``jit``, ``vmap``, ``grad``, ``scan``). :func:`policies_in` reads them back from a
jaxpr and :func:`check` compares them with the config of ``jaxamp.init`` (or of any other
jaxamp entry point), raising a :class:`~jaxamp.ConfigError` naming both.

The config is passed, never ambient: ``autocast(fn, amp)`` takes it as an argument and the
program carries it to every entry point that traces the network, which checks it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, List, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

from jaxamp._src.scaling.config import AmpConfig, ConfigError
from jaxamp._src.core.interpreter import sub_jaxprs
from jaxamp._src.core.rules import RULES, PrimitiveRules

__all__ = ["Policy", "policy_p", "mark", "policies_in", "derivative_taken", "check"]

# The settings that change what a program computes or how it is scaled; the other keys
# (max scales, scaler hyper-parameters) only tune the scalers that init builds.
FIELDS = ("enabled", "dtype", "derivative_scaling")


@dataclasses.dataclass(frozen=True)
class Policy:
    """What one ``autocast`` ran under: its config's :data:`FIELDS` and the function's name.
    ``amp.dtype`` is stored as ``amp_dtype``: ``jnp.dtype`` would read a param's ``dtype``."""

    enabled: bool
    amp_dtype: str
    derivative_scaling: bool
    fn: str = "fn"

    @classmethod
    def of(cls, amp: AmpConfig, fn: str = "fn") -> "Policy":
        return cls(amp.enabled, amp.dtype, amp.derivative_scaling, fn)

    def items(self) -> List[Tuple[str, Any]]:
        """``[(config key, value)]`` for the :data:`FIELDS`."""
        return list(zip(FIELDS, (self.enabled, self.amp_dtype, self.derivative_scaling)))

    def differences(self, amp: AmpConfig) -> List[str]:
        """``["dtype='float16' vs dtype='bfloat16'", ...]``: this policy's value first, one per field that differs."""
        return [f"{k}={v!r} vs {k}={getattr(amp, k)!r}" for k, v in self.items() if v != getattr(amp, k)]

    def describe(self) -> str:
        """``"amp.enabled=True, amp.dtype='float16', amp.derivative_scaling=True"``."""
        return ", ".join(f"amp.{k}={v!r}" for k, v in self.items())


# ---------------------------------------------------------------- policy_p
# policy_p(x) -> x. `policy` is static; `derivative` is True for the marks that JAX's jvp and
# transpose rules make: they say that a derivative through the network was taken.
policy_p = jcore.Primitive("jaxamp_policy")


def _identity(x, **_):
    return x


def _jvp(primals, tangents, *, policy, derivative):
    (x,), (t,) = primals, tangents
    out = policy_p.bind(x, policy=policy, derivative=derivative)
    if type(t) is ad.Zero:
        return out, t
    return out, policy_p.bind(t, policy=policy, derivative=True)


def _transpose(ct, x, *, policy, derivative):
    # Linear in x (the identity): the cotangent passes through, marked as a derivative.
    if type(ct) is ad.Zero:
        return [ct]
    return [policy_p.bind(ct, policy=policy, derivative=True)]


def _batch(args, dims, *, policy, derivative):
    return policy_p.bind(*args, policy=policy, derivative=derivative), dims[0]


policy_p.def_impl(_identity)
policy_p.def_abstract_eval(lambda x, **_: x)  # the operand's type itself (shape, dtype, weak type)
ad.primitive_jvps[policy_p] = _jvp
ad.primitive_transposes[policy_p] = _transpose
batching.primitive_batchers[policy_p] = _batch
mlir.register_lowering(policy_p, lambda ctx, x, **_: [x])  # no operation in the compiled program
RULES[policy_p] = PrimitiveRules(taylor="linear")  # the identity


def mark(outputs: Any, policy: Policy) -> Any:
    """``outputs`` (a pytree) with its first floating leaf marked with ``policy`` (or, when it
    has none, a marked float32 zero beside it, so that the program still carries the policy)."""
    leaves, tree = jax.tree_util.tree_flatten(outputs)
    for i, leaf in enumerate(leaves):
        if jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            leaves[i] = policy_p.bind(leaf, policy=policy, derivative=False)
            return jax.tree_util.tree_unflatten(tree, leaves)
    policy_p.bind(jnp.zeros((), jnp.float32), policy=policy, derivative=False)
    return outputs


def _marks(jaxpr: Any) -> Iterator[jcore.JaxprEqn]:
    """Every policy_p equation of ``jaxpr`` (open or closed) and of its sub-jaxprs."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        if eqn.primitive is policy_p:
            yield eqn
        for sub in sub_jaxprs(eqn):
            yield from _marks(sub)


def policies_in(jaxpr: Any) -> List[Policy]:
    """The policies of the ``autocast`` networks in ``jaxpr`` (open or closed), once each.

    Example:
      >>> import jax, jax.numpy as jnp, jaxamp
      >>> net = jaxamp.autocast(lambda w, x: jnp.tanh(x @ w) @ w, jaxamp.AmpConfig())
      >>> closed = jax.make_jaxpr(net)(jnp.ones((2, 2)), jnp.ones((1, 2)))
      >>> [(p.amp_dtype, p.enabled) for p in policies_in(closed)]
      [('float16', True)]
    """
    return list(dict.fromkeys(eqn.params["policy"] for eqn in _marks(jaxpr)))


def derivative_taken(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` takes a derivative through an ``autocast`` network (JAX's or jaxamp's)."""
    return any(eqn.params["derivative"] for eqn in _marks(jaxpr))


def check(policies: Sequence[Policy], amp: AmpConfig, caller: str, against: str = "`amp`") -> None:
    """Raise a :class:`~jaxamp.ConfigError` if a policy differs from ``amp`` (described as
    ``against``) in :data:`FIELDS`, naming both values and the fix."""
    for policy in policies:
        diffs = policy.differences(amp)
        if diffs:
            raise ConfigError(
                f"{caller}: autocast({policy.fn}) runs under {policy.describe()}, but {against} has "
                f"{Policy.of(amp).describe()} (autocast's vs that one: "
                f"{'; '.join(diffs)}). Fix: declare the AMP config once and pass the same AmpConfig to both, "
                "e.g. autocast(model.apply, amp) and jaxamp.init(loss, amp)."
            )
