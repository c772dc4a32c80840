"""The original ``bagua.torch_api.algorithms.base``: ``Algorithm``, ``AlgorithmImpl`` and
``GlobalAlgorithmRegistry`` over the native ``bagua.algorithms``.

``Algorithm.init(name, **kwargs)`` and the registry build the original's classes (with its
defaults, e.g. ``hierarchical=True`` for bytegrad). ``AlgorithmImpl`` is the native one: an
implementation written against the original's hooks (``init_tensors``, ``init_operations`` on
``BaguaBucket``) needs porting, see docs/writing_an_algorithm.md.

Example::

    from bagua.torch_api.algorithms import Algorithm, GlobalAlgorithmRegistry
    algo = Algorithm.init("bytegrad")            # ByteGradAlgorithm(hierarchical=True)
    GlobalAlgorithmRegistry.available_algorithms()
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ...algorithms import Algorithm as _NativeAlgorithm
from ...algorithms import AlgorithmImpl

__all__ = ["Algorithm", "AlgorithmImpl", "GlobalAlgorithmRegistry"]


class Algorithm(_NativeAlgorithm):
    """The native ``bagua.algorithms.Algorithm`` whose ``init`` looks names up in
    ``GlobalAlgorithmRegistry``, as the original did."""

    @classmethod
    def init(cls, name: str, **kwargs: Any) -> _NativeAlgorithm:
        """Build the algorithm registered as ``name`` with ``kwargs``."""
        return GlobalAlgorithmRegistry.get(name)(**kwargs)


class _AlgorithmRegistry(dict):
    """name -> {"algorithm": class, "description": str}, the original's registry."""

    def register(self, name: str, algorithm: Callable, description: Optional[str] = None) -> None:
        """Register ``algorithm`` (a class building an ``Algorithm``) as ``name``.

        Raises:
            TypeError: ``name`` is not a string.
            ValueError: ``name`` is already registered.
        """
        if not isinstance(name, str):
            raise TypeError(f"`name` must be a str, found {name!r}")
        if name in self:
            raise ValueError(f"'{name}' is already present in the registry.")
        self[name] = {"algorithm": algorithm, "description": description or ""}

    def get(self, name: str) -> Callable:
        """The class registered as ``name`` (KeyError listing the registered names otherwise)."""
        if name not in self:
            raise KeyError(f"'{name}' not found in registry. Available names: {', '.join(sorted(self)) or 'none'}")
        return self[name]["algorithm"]

    def available_algorithms(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self)

    def __str__(self) -> str:
        return f"Registered Algorithms: {', '.join(self)}"


GlobalAlgorithmRegistry = _AlgorithmRegistry()
"""The original's registry of algorithms by name: ``register(name, cls)``, ``get(name)``, ``available_algorithms()``."""
