"""Algorithm registry: one module per algorithm, looked up by the name in the experiment config.

Modules in this package that define a ``Strategy`` subclass with a ``name`` register themselves by
being here — adding an algorithm means adding one file, and no list elsewhere can forget it.

``get(name)`` imports only ``shared/algorithms/<name>.py`` (each algorithm lives in the module named
after it); the full ``REGISTRY`` imports every module on first use. Why: most algorithm modules
import torch, and an aggregator of a torch-free algorithm (FedAvg) must not import them.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from shared.algorithms.base import Strategy, StrategyContext
from shared.config import RobustConfig, TrainConfig

_INFRA = {"base", "training", "device_state", "dynamic_pruning", "width_slicing", "robust"}


def _discover() -> dict[str, type[Strategy]]:
    found: dict[str, type[Strategy]] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name in _INFRA or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, Strategy) and obj.__module__ == module.__name__ and "name" in obj.__dict__:
                if obj.name in found:
                    raise RuntimeError(f"algorithm name {obj.name!r} defined twice")
                found[obj.name] = obj
    return found


if TYPE_CHECKING:
    REGISTRY: dict[str, type[Strategy]]


def _registry() -> dict[str, type[Strategy]]:
    """Every algorithm (importing every algorithm module, once)."""
    registry: dict[str, type[Strategy]] | None = globals().get("REGISTRY")
    if registry is None:
        registry = _discover()
        globals()["REGISTRY"] = registry
    return registry


def __getattr__(name: str) -> Any:
    if name == "REGISTRY":
        return _registry()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _own_module(name: str) -> type[Strategy] | None:
    """The strategy called ``name`` in ``shared/algorithms/<name>.py``, importing nothing else."""
    if not name.isidentifier() or name in _INFRA or name.startswith("_"):
        return None
    if not any(info.name == name for info in pkgutil.iter_modules(__path__)):
        return None
    module = importlib.import_module(f"{__name__}.{name}")
    for _, obj in inspect.getmembers(module, inspect.isclass):
        if (
            issubclass(obj, Strategy)
            and obj.__module__ == module.__name__
            and obj.__dict__.get("name") == name
        ):
            return obj
    return None


def get(name: str) -> type[Strategy]:
    found = _own_module(name)
    if found is not None:
        return found
    registry = _registry()
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; available: {', '.join(sorted(registry))}") from None


def parse_options(name: str, options: dict[str, Any], source: str = "algorithm.options") -> Any:
    """Validate an algorithm's options with its own model (unknown keys are errors)."""
    cls = get(name)
    try:
        return cls.Options.model_validate(options)
    except ValidationError as err:
        lines = [f"{source}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
        raise ValueError("\n".join(lines)) from None


def check_train(name: str, train: TrainConfig) -> None:
    """Refuse training settings the algorithm would silently ignore (``train.local_steps``)."""
    if train.local_steps is not None and not get(name).supports_local_steps:
        registry = _registry()
        takes = sorted(n for n, cls in registry.items() if cls.supports_local_steps)
        raise ValueError(
            f"train.local_steps: algorithm {name!r} counts its local work itself and would ignore it; "
            f"use train.local_epochs (or its own options). local_steps applies to: {', '.join(takes)}"
        )


def check_robust(name: str, robust: RobustConfig) -> None:
    """Refuse a ``robust:`` option the algorithm cannot use, with the reason."""
    from shared.algorithms import robust as robust_module

    robust_module.check(get(name), robust)


__all__ = [
    "REGISTRY",
    "Strategy",
    "StrategyContext",
    "check_robust",
    "check_train",
    "get",
    "parse_options",
]
