"""One round of the server, as one object: who was asked, who answered, what was merged, and when.

Why an object per round: everything in it lives exactly as long as the round. Created when the round
opens and dropped when it is finalized, it cannot leak a previous round's receipts or deadline into
the next one, and "what happens when an update arrives" is answered here, in one place:

1. the device's update reaches an aggregator, which validates and reduces it and sends a **receipt**
   (:meth:`RoundState.receipt`): the device is now *accounted for*;
2. the aggregator later sends the **partial** holding it; :meth:`RoundState.decide_partial` says
   whether the server may merge it (every device in it selected, none already covered);
3. when every selected device is accounted for (receipt, refusal, dropout, unreachable, discarded),
   or the deadline passes with a quorum, the server flushes; the round is complete once every
   receipted device is *covered* by exactly one merged partial.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from services.server.fanout import Fanout
from shared.algorithms.base import Partial, Strategy
from shared.schemas import EvalResult, Ready, Receipt, Reject, RoundOpen


class Phase(StrEnum):
    """What the server is doing; ``Server.tick`` runs the method of the current phase."""

    #: waiting for hosts to join and serve the fleet
    REGISTERING = "registering"
    #: between rounds: waiting until every host applied its new lease
    SETTLING = "settling"
    #: a round could not open (no aggregator listening); retried every ``FLUSH_RETRY_S``
    WAITING = "waiting"
    #: tasks sent; receipts, refusals and readies arrive
    OPEN = "open"
    #: asked the aggregators for their partials; merging until every receipt is covered
    FLUSHING = "flushing"
    #: between a finalized round and the next one (only inside ``_finalize``)
    BETWEEN = "between"
    #: after the last round of a personalised algorithm: every device evaluates its own model
    EVALUATING = "evaluating"
    #: results written, ``stop`` broadcast
    DONE = "done"


@dataclass
class RoundState:
    """The open round: created by ``Server._open_round``, consumed by ``Server._finalize``."""

    number: int
    #: the devices invited this round (sorted)
    selected: list[int]
    #: registered devices that were offline at selection time (not invited)
    offline: int
    #: the key of this round's task tokens (``shared.schemas.task_token``)
    key: str
    started: float
    deadline: float
    announcement: RoundOpen
    last_announced: float
    receipts: dict[int, Receipt] = field(default_factory=dict)
    rejects: dict[int, Reject] = field(default_factory=dict)
    #: selected devices whose task nobody could receive (no client hosts them any more)
    unreachable: set[int] = field(default_factory=set)
    #: devices whose update is inside a merged partial
    covered: set[int] = field(default_factory=set)
    merged: Partial | None = None
    flush_deadline: float = math.inf
    last_flush: float = 0.0
    #: wire and dense-equivalent bytes of the tasks that reached a client
    down_bytes: int = 0
    dense_down: int = 0
    task_bytes: dict[int, int] = field(default_factory=dict)
    #: first-finishers protocol: trained devices waiting for ``go``
    readies: dict[int, Ready] = field(default_factory=dict)
    go_sent: bool = False
    #: selected devices that will not be aggregated, with why: dropout, deadline, surplus
    discarded: dict[int, str] = field(default_factory=dict)
    #: the round's task messages (payloads kept to answer a host's fetch)
    fanout: Fanout | None = None
    #: the server's broker traffic (published + consumed) when the round opened
    broker_mark: int = 0

    def __post_init__(self) -> None:
        self._selected_set = frozenset(self.selected)

    def is_selected(self, device: int) -> bool:
        return device in self._selected_set

    # -- arrivals ----------------------------------------------------------------------------------
    def receipt(self, msg: Receipt) -> None:
        """An aggregator reduced this device's update (the first receipt counts; repeats are ignored)."""
        if self.is_selected(msg.device_id):
            self.receipts.setdefault(msg.device_id, msg)

    def decide_partial(self, devices: list[int], singleton: bool) -> tuple[bool, str]:
        """May a partial over ``devices`` be merged? (accepted, refusal reason).

        A partial that overlaps the covered devices is refused: a normal partial's updates are then
        requeued by its aggregator and come back one by one (``singleton``), and a singleton for a
        covered device is a duplicate. That is what counts every update exactly once.
        """
        if set(devices) & self.covered:
            return False, "duplicate" if singleton else "overlap"
        if not set(devices) <= self._selected_set:
            return False, "unknown-device"
        return True, ""

    def merge(self, strategy: Strategy, partial: Partial, devices: list[int]) -> None:
        self.merged = partial if self.merged is None else strategy.merge(self.merged, partial)
        self.covered.update(devices)

    # -- progress ----------------------------------------------------------------------------------
    def silent(self) -> set[int]:
        """Selected devices that will send no update: refused, unreachable, dropped or discarded."""
        return set(self.rejects) | self.unreachable | set(self.discarded)

    def all_ready(self) -> bool:
        """First-finishers protocol: every selected device has either reported ``ready`` or is silent."""
        return set(self.readies) | self.silent() >= self._selected_set

    def all_accounted(self) -> bool:
        """Every selected device has a receipt or will never send one."""
        return set(self.receipts) | self.silent() >= self._selected_set

    def all_covered(self) -> bool:
        """Every receipted update is inside a merged partial."""
        return self.covered >= set(self.receipts)

    def quorum(self, devices_per_round: int, fraction: float) -> int:
        target = min(devices_per_round, len(self.selected))
        return max(1, math.ceil(fraction * target))

    def participants(self) -> list[int]:
        return sorted(self.covered) if self.merged is not None else []

    def dropped(self) -> list[int]:
        """Selected devices that neither contributed nor refused (a surplus finisher is not dropped)."""
        return [
            d
            for d in self.selected
            if d not in self.covered and d not in self.rejects and self.discarded.get(d) != "surplus"
        ]

    def drop_reason(self, device: int) -> str:
        return "unreachable" if device in self.unreachable else self.discarded.get(device, "deadline")


@dataclass
class EvaluationState:
    """The all-device evaluation after the last round of a personalised algorithm."""

    key: str
    expected: set[int]
    deadline: float
    down_bytes: int
    results: dict[int, EvalResult] = field(default_factory=dict)
    fanout: Fanout | None = None

    def done(self, now: float) -> bool:
        return set(self.results) >= self.expected or now >= self.deadline

    def missing(self) -> list[int]:
        return sorted(self.expected - set(self.results))
