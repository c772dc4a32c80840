"""``Trainer(strategy="bagua")`` once bagua and Lightning are both imported, in either order.

Lightning checks a strategy name against its ``StrategyRegistry`` when the Trainer is built and
offers third-party strategies no discovery hook: no entry-point group for strategies (its one
entry-point group, ``lightning.pytorch.callbacks_factory``, is read after that check), only the
registry that ``lightning.pytorch.strategies`` creates. So ``import bagua`` registers the name
at once when that module is already imported, and otherwise watches for its import (a finder on
``sys.meta_path`` that fires once and removes itself). The name is registered lazily: bagua's
strategy module is imported only when a Trainer asks for ``"bagua"``, and ``import bagua``
imports no part of Lightning. A program that imports neither ``bagua`` nor ``lightning_bagua``
gets Lightning's "invalid strategy name" error.

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
from typing import Any, Optional

logger = logging.getLogger(__name__)

STRATEGIES_MODULE = "lightning.pytorch.strategies"
STRATEGY_NAME = "bagua"


def register_with_lightning() -> None:
    """Register ``strategy="bagua"`` now if Lightning's strategies are imported, else when they are."""
    strategies = sys.modules.get(STRATEGIES_MODULE)
    if strategies is not None:
        _register(strategies)
    elif not any(isinstance(finder, _WatchLightning) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WatchLightning())


def _make_strategy(**kwargs: Any) -> Any:
    from .lightning import BaguaStrategy  # registers the class itself in place of this factory

    return BaguaStrategy(**kwargs)


def _register(strategies: ModuleType) -> None:
    try:
        registry = strategies.StrategyRegistry
        if STRATEGY_NAME not in registry:
            registry.register(STRATEGY_NAME, _make_strategy, description="Bagua's distributed algorithms (bagua.lightning)")
    except Exception as error:  # a Lightning whose registry differs: the import of Lightning must still work
        logger.warning("bagua could not register Trainer(strategy='bagua') with Lightning (%s: %s); "
                       "import bagua.lightning first, or pass strategy=bagua.lightning.BaguaStrategy()",
                       type(error).__name__, error)


class _WatchLightning(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``lightning.pytorch.strategies`` is imported, lets the other
    finders find it and registers the name right after the module ran."""

    def find_spec(self, fullname: str, path: Any = None, target: Optional[ModuleType] = None) -> Any:
        if fullname != STRATEGIES_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RegisterAfter(spec.loader)
        return spec


class _RegisterAfter(importlib.abc.Loader):
    """Runs the module with its own loader (restored on the module), then registers the name."""

    def __init__(self, loader: Any):
        self.loader = loader

    def create_module(self, spec: Any) -> Optional[ModuleType]:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _register(module)
