"""Settings and scaling state: :class:`AmpConfig` and its value checks, the dynamic scaler rules,
:class:`AmpState`. Imports nothing else of jaxamp."""

__all__: list = []
