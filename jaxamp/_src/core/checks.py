"""Argument checks shared by the entry points (``scaled``, ``value_and_grad``) and the derivative
transforms (``grad`` and its siblings, ``laplacian``): each raises before any work, naming the
argument, its value and what is allowed."""

from __future__ import annotations

from typing import Any, Tuple, Union

__all__ = ["check_name", "check_fun", "check_wrt"]


def check_name(arg: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise TypeError(f"jaxamp: `{arg}`={value!r} must be a non-empty string (a variable name).")


def check_fun(caller: str, fun: Any, of: Any) -> None:
    """Raise unless ``fun`` is callable and ``of`` is None or a variable name."""
    if not callable(fun):
        raise TypeError(f"{caller}: `fun`={fun!r} must be callable.")
    if of is not None:
        check_name("of", of)


def check_wrt(caller: str, argnums: Any, wrt: Any) -> Union[int, Tuple[int, ...]]:
    """Validate ``argnums`` (an int or a tuple of ints) and ``wrt`` (one name per argnum)."""
    multi = not isinstance(argnums, int)
    if multi and not (isinstance(argnums, (tuple, list)) and all(isinstance(a, int) for a in argnums)):
        raise TypeError(f"{caller}: `argnums`={argnums!r} must be an int or a tuple of ints.")
    if wrt is not None:
        names = (wrt,) if isinstance(wrt, str) else tuple(wrt)
        for n in names:
            check_name("wrt", n)
        if isinstance(wrt, str) == multi or (multi and len(names) != len(argnums)):
            raise ValueError(f"{caller}: `wrt`={wrt!r} must be one name for an int `argnums` or a "
                             f"tuple of {len(argnums) if multi else 1} names for "
                             f"`argnums`={argnums!r}.")
    return tuple(argnums) if multi else argnums
