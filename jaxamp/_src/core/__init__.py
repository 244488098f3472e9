"""The core: the mark primitives and key rule (marks), the rule table of every primitive jaxamp's
interpreters treat specially (rules), a derivative's order from the program (nesting), the one
interpreter (interpreter, evaluate, control, scaled), profile, the float16 window, the network
boundary, the autocast policy and module detection. Imports only :mod:`jaxamp._src.scaling`."""

__all__: list = []
