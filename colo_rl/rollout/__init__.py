"""Rollout engines behind one protocol (base.py), registered by name in ENGINES (`rollout.engine`).

Every module of this package is imported here, so an engine's module registers it: adding an engine
is its module (an `Engine` subclass under `@ENGINES.register`), its conf/rollout/*.yaml and its extra.
"""

import importlib
import pkgutil

from colo_rl.rollout.base import ENGINES, Capabilities, Engine, capabilities_of

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["ENGINES", "Capabilities", "Engine", "capabilities_of"]
