"""One round of the server, as one object: who was asked, who answered, what was merged, and when.

Why an object per round: everything in it lives exactly as long as the round. Created when the round
opens and dropped when it is finalized, it cannot leak a previous round's receipts or deadline into
the next one, and "what happens when an update arrives" is answered here, in one place:

1. the device's update reaches an aggregator, which validates and reduces it and sends a **receipt**
   (:meth:`RoundState.receipt`): the device is now *accounted for*;
2. the aggregator sends the **partial** holding it, just before that receipt or later;
   :meth:`RoundState.decide_partial` says whether the server may merge it (every device in it
   selected, none already covered);
3. when every selected device is accounted for (receipt, refusal, dropout, unreachable, discarded)
   the round is complete if it is :meth:`~RoundState.settled` (every receipted device *covered* by
   exactly one merged partial, every covered device's receipt arrived); if not, or when the
   deadline passes with a quorum, the server flushes, and the round is complete once settled.

An aggregator sends a partial *ahead* of its updates' receipts (so that the last receipt finds its
update merged and the round ends without a flush round trip); for a moment, then, a device can be
covered without a receipt. The round waits for that receipt (:meth:`RoundState.settled`), which
carries the device's bytes, timings and metrics: a round is never finalized with a merged update
whose receipt is still in flight, except at the flush deadline.

A round that ends with nothing merged is either ``below-quorum`` (the fleet, as emulated, could not
deliver: refusals, dropouts, the emulated deadline) or ``lost`` (the broker lost it:
:meth:`RoundState.lost_to_broker` says which); a lost round is opened again as a new attempt of
the same round (``attempt``, :class:`RepeatPolicy`), not counted as a result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from services.server.fanout import Fanout
from shared.algorithms.base import Partial, Strategy, TaskSpec
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
    #: asked the aggregators for their partials; merging until the round is settled
    FLUSHING = "flushing"
    #: between a finalized round and the next one (only inside ``_finalize``)
    BETWEEN = "between"
    #: a round the broker lost waits for its pause to end, then opens again (its next attempt)
    REPEATING = "repeating"
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
    #: the strategy's plan for the round (kept so that a lost round is repeated with the same tasks:
    #: planning again could advance a strategy's state)
    tasks: dict[int, TaskSpec] = field(default_factory=dict)
    #: 1 for the first opening of this round number, 2 for its first repeat, ...
    attempt: int = 1
    #: the transport's fault count (``Transport.faults``) when the round opened
    faults_mark: int = 0
    #: when an earlier attempt of this round was first lost (None: the first attempt)
    first_lost: float | None = None
    #: a repeat waiting in ``Phase.REPEATING``: when its pause ends
    resume_at: float = 0.0
    #: the flush deadline passed with receipted updates no partial brought
    flush_timed_out: bool = False
    #: devices receipted in an earlier, lost attempt of this round: an aggregator still holding
    #: their updates merges them in this attempt without receipting them again (their bytes are in
    #: the lost attempt's row)
    earlier_receipts: frozenset[int] = frozenset()

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

    def settled(self) -> bool:
        """Every receipted update is merged and every merged update's receipt has arrived (it
        follows its partial: see the module docstring), in this attempt or a lost one."""
        receipted = set(self.receipts)
        return receipted <= self.covered and self.covered <= receipted | self.earlier_receipts

    def answering(self) -> int:
        """Selected devices whose update reached an aggregator: receipted or already merged."""
        return len(set(self.receipts) | self.covered)

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

    # -- lost to the broker? -------------------------------------------------------------------------
    def answered(self) -> set[int]:
        """Selected devices that gave any sign of life this round: an update (its receipt, or its
        refusal as out of bounds), a refusal, a dropout notice, a ``ready``."""
        notices = {d for d, why in self.discarded.items() if why in EMULATED_DISCARDS}
        return set(self.receipts) | set(self.rejects) | set(self.readies) | notices

    def missing(self, emulated_silent: set[int]) -> set[int]:
        """Selected devices whose silence the emulation does not explain: no update, no refusal, no
        emulated discard, and not a device the emulation drops this round (``emulated_silent``: a
        dropout in ``real`` time sends no notice). Unreachable devices and those of a lost host count:
        neither is something the emulation decided."""
        return set(self._selected_set - self.answered() - emulated_silent)

    def lost_to_broker(
        self, emulated_silent: set[int], broker_fault: bool, *, real_time: bool = False
    ) -> str | None:
        """Why this round, which merged nothing, was lost to the broker — or None when it simply fell
        below the quorum.

        The rule (the server cannot see the broker's queues, only what reaches it):

        * nothing was merged (a round with a participant is a result, if a smaller one), and
        * some selected device is *missing* (:meth:`missing`): silent for no emulated reason. A
          round whose every device refused, dropped out or finished after the emulated deadline is
          the emulation's verdict and stays ``below-quorum`` (repeating it would repeat it), and
        * either an update an aggregator had receipted never reached the server in a partial (the
          flush timed out: the aggregators or their partials were lost; checked first), or
        * **no** device expected to answer answered at all — no receipt, refusal, dropout
          notice or ``ready`` arrived from any selected device's host, which no emulated behaviour
          produces: a reachable device always answers its task — or the server's own transport
          lost its connection or had a consumer cancelled while the round was open
          (``broker_fault``), so that whatever the missing devices sent may have gone with it.

        The first clause also covers a round nobody could answer within ``round_timeout_s`` (a
        deadline shorter than one local training, or a first round slowed by a busy machine): the
        repeat takes the late answers that arrived meanwhile, and a round that stays silent fails
        the run naming both causes instead of going on with empty rounds. In ``real`` time mode
        (``real_time``) devices throttle in wall time, so a round whose every device is a straggler
        at ``round_timeout_s`` is the emulation's: there only the second clause applies.
        """
        if self.covered:
            return None
        stranded = set(self.receipts) if self.flush_timed_out else set()
        if stranded:
            # a receipt says an aggregator holds the update; no emulated behaviour loses it after that
            return (
                f"{len(stranded)} updates reached an aggregator but no partial brought them (flush timed out)"
            )
        missing = self.missing(emulated_silent)
        if not missing:
            return None
        expected = self._selected_set - emulated_silent
        if not real_time and not self.answered() & expected:
            return f"none of the {len(expected)} devices expected to answer did (no update, refusal, notice)"
        if broker_fault:
            return f"the broker connection failed during the round and {len(missing)} devices stayed silent"
        return None


#: discards that are the emulation's own answer (a dropout notice, a ``ready`` past the emulated
#: deadline or beyond the kept finishers), as opposed to ``host-lost``
EMULATED_DISCARDS = frozenset({"dropout", "deadline", "surplus"})

#: at most this many repeats of one lost round (on top of the reconnect budget, which bounds time)
ROUND_REPEATS = 3


@dataclass(frozen=True)
class RepeatPolicy:
    """How a lost round is repeated: at most ``repeats`` times, after a pause that starts at
    ``backoff_s`` and doubles up to ``backoff_max_s``, and only while the time since the round was
    first lost is within ``budget_s``. The broker settings (``FEDFLEET_RECONNECT_*``) are the
    defaults: a lost round waits for the broker exactly as long as a lost connection does."""

    repeats: int = ROUND_REPEATS
    budget_s: float = 120.0
    backoff_s: float = 0.25
    backoff_max_s: float = 5.0

    @classmethod
    def from_settings(cls) -> RepeatPolicy:
        from shared.config import Settings

        s = Settings()
        return cls(
            budget_s=s.reconnect_budget_s,
            backoff_s=s.reconnect_backoff_s,
            backoff_max_s=s.reconnect_backoff_max_s,
        )

    def pause(self, attempt: int) -> float:
        """The pause before opening attempt ``attempt + 1`` of a round."""
        return float(min(self.backoff_s * 2 ** (attempt - 1), self.backoff_max_s))


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
