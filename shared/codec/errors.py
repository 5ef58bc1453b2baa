"""The single exception type of the codec.

Every failure -- a bad tensor handed to ``encode``, a hostile or corrupt payload handed to ``decode`` or
``unpackb`` -- surfaces as :class:`CodecError`, so a service can route *any* bad message to its
dead-letter queue with one ``except`` clause and label the metric with ``err.reason``. It subclasses
``ValueError`` because a bad payload is a bad value, and code that already catches ``ValueError`` keeps
working.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

Reason = Literal[
    "malformed",  # not msgpack / wrong structure: missing or unknown field, wrong field type, ext type
    "oversized",  # raw message longer than the caller's byte budget (checked before parsing)
    "version",  # payload written by an incompatible codec version
    "kind",  # unknown tensor kind or sparse format
    "dtype",  # dtype string not in the allow-list (or wrong family, e.g. an integer threshold vector)
    "shape",  # negative dimension, or a rank the kind does not allow (threshold vectors are 1-D)
    "limits",  # rank or element count above the receiver's Limits
    "tensor",  # contents disagree with the declared shape: buffer lengths, indices, bitmask bits
    "nonfinite",  # NaN or +-Inf in float values while Limits.allow_nonfinite is False
    "type",  # packb was given something that is not a plain msgpack type
]

REASONS: Final[frozenset[str]] = frozenset(get_args(Reason))


class CodecError(ValueError):
    """A tensor or message could not be encoded or decoded.

    ``reason`` is a short machine-readable token (one of :data:`REASONS`), stable enough to use as a
    Prometheus label; the message says what was wrong and what was expected, for a person reading logs.
    """

    reason: str

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(f"[{reason}] {message}")
        self.reason = reason
        self.detail = message

    def __reduce__(self) -> tuple[type[CodecError], tuple[str, str]]:
        # The default pickling would call CodecError(formatted_message) and fail; errors do cross
        # process boundaries (multiprocessing, test workers), so keep them picklable.
        return (CodecError, (self.reason, self.detail))
