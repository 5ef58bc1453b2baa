"""What a training task costs in memory, as plain numbers: no torch here.

Why apart from ``memory`` (which measures footprints by running torch): the aggregator and the strategy
interface name these types without training anything, and must not import torch to do so (issue 16,
lean processes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Optimizer = Literal["sgd", "sgd_momentum", "adam"]


@dataclass(frozen=True)
class TrainingFootprint:
    """Bytes of one training task, by component (what admission compares with the memory budget)."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    #: memory that is none of the four (EmbracingFL's cached prefix outputs, the excess of a
    #: forward-only phase over training): its own term, so an admission message names it instead of
    #: inflating the activations
    other_bytes: int = 0
    #: what ``other_bytes`` is, for the admission message
    other_label: str = "other"

    @property
    def total(self) -> int:
        return (
            self.params_bytes
            + self.grads_bytes
            + self.optimizer_bytes
            + self.activations_bytes
            + self.other_bytes
        )

    def as_dict(self) -> dict[str, int]:
        return {
            "params_bytes": self.params_bytes,
            "grads_bytes": self.grads_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "activations_bytes": self.activations_bytes,
            "other_bytes": self.other_bytes,
            "total": self.total,
        }
