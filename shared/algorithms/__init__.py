"""Algorithm registry: one module per algorithm, looked up by the name in the experiment config."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from shared.algorithms.base import Strategy, StrategyContext
from shared.algorithms.fedavg import FedAvg

REGISTRY: dict[str, type[Strategy]] = {cls.name: cls for cls in (FedAvg,)}


def get(name: str) -> type[Strategy]:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; available: {', '.join(sorted(REGISTRY))}") from None


def parse_options(name: str, options: dict[str, Any], source: str = "algorithm.options") -> Any:
    """Validate an algorithm's options with its own model (unknown keys are errors)."""
    cls = get(name)
    try:
        return cls.Options.model_validate(options)
    except ValidationError as err:
        lines = [f"{source}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
        raise ValueError("\n".join(lines)) from None


__all__ = ["REGISTRY", "Strategy", "StrategyContext", "get", "parse_options"]
