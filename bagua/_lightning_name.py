"""``Trainer(strategy="bagua")`` once bagua and Lightning are both imported, in either order.

Lightning checks a strategy name against its ``StrategyRegistry`` when the Trainer is built and
offers third-party strategies no discovery hook: no entry-point group for strategies (its one
entry-point group, ``lightning.pytorch.callbacks_factory``, is read after that check), only the
registry that ``lightning.pytorch.strategies`` creates. So ``import bagua`` registers the name
at once when that module is already imported, and otherwise watches for its import (a finder on
``sys.meta_path`` that fires once and removes itself). The name is registered lazily: bagua's
strategy module is imported only when a Trainer asks for ``"bagua"``, and ``import bagua``
imports no part of Lightning. A program that imports neither ``bagua`` nor ``lightning_bagua``
gets Lightning's "invalid strategy name" error. The standalone ``pytorch_lightning`` package has a
registry of its own and a Trainer that cannot take ``lightning.pytorch`` strategies: there the
name is registered to an error saying which Trainer to import.

Example::

    import bagua                         # before or after Lightning
    import lightning.pytorch as pl
    trainer = pl.Trainer(strategy="bagua", accelerator="cpu", devices=2)
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from types import ModuleType
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

STRATEGY_NAME = "bagua"


def register_with_lightning() -> None:
    """Register ``strategy="bagua"`` now where Lightning's strategies are imported, else when they are."""
    pending = [name for name in _FACTORIES if name not in sys.modules]
    for name in _FACTORIES:
        if name in sys.modules:
            _register(sys.modules[name], _FACTORIES[name])
    if pending and not any(isinstance(finder, _WatchLightning) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WatchLightning(pending))


def _make_strategy(**kwargs: Any) -> Any:
    from .lightning import BaguaStrategy  # registers the class itself in place of this factory

    return BaguaStrategy(**kwargs)


def _refuse_standalone(**kwargs: Any) -> Any:
    raise ImportError(
        "Trainer(strategy='bagua') is a strategy of the lightning package's Trainer (lightning.pytorch), "
        "not of the standalone pytorch_lightning package's: import the Trainer with "
        "`import lightning.pytorch as pl` (or `from lightning import Trainer`)"
    )


# Lightning's strategy registries: the lightning package's, and the standalone pytorch_lightning
# package's, whose Trainer cannot take a lightning.pytorch strategy (its failure says so)
_FACTORIES: dict[str, Callable[..., Any]] = {
    "lightning.pytorch.strategies": _make_strategy,
    "pytorch_lightning.strategies": _refuse_standalone,
}


def _register(strategies: ModuleType, factory: Callable[..., Any]) -> None:
    try:
        registry = strategies.StrategyRegistry
        if STRATEGY_NAME not in registry:
            registry.register(STRATEGY_NAME, factory, description="Bagua's distributed algorithms (bagua.lightning)")
    except Exception as error:  # a Lightning whose registry differs: the import of Lightning must still work
        logger.warning("bagua could not register Trainer(strategy='bagua') with %s (%s: %s); "
                       "import bagua.lightning first, or pass strategy=bagua.lightning.BaguaStrategy()",
                       strategies.__name__, type(error).__name__, error)


class _WatchLightning(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when one of Lightning's strategy modules is imported, lets the other
    finders find it and registers the name right after the module ran; gone once all were seen."""

    def __init__(self, pending: list[str]):
        self.pending = set(pending)

    def find_spec(self, fullname: str, path: Any = None, target: Optional[ModuleType] = None) -> Any:
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        sys.meta_path.remove(self)  # out of the way while the others find the module
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            if self.pending:
                sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RegisterAfter(spec.loader, _FACTORIES[fullname])
        return spec


class _RegisterAfter(importlib.abc.Loader):
    """Runs the module with its own loader (restored on the module), then registers the name."""

    def __init__(self, loader: Any, factory: Callable[..., Any]):
        self.loader, self.factory = loader, factory

    def create_module(self, spec: Any) -> Optional[ModuleType]:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _register(module, self.factory)
