"""The core: the mark primitives and key rule (marks), a derivative's order from the program
(nesting), the one interpreter (interpreter, control, scaled), profile, the float16 window, the
autocast policy and module detection. Imports only :mod:`jaxamp._src.scaling`."""

__all__: list = []
