"""Errors the CLI turns into one clear line; kept apart so importing them loads nothing heavy
(the ``fedfleet run`` parent never imports torch)."""


class CheckpointError(RuntimeError):
    """No usable checkpoint (or one that must not be written), said in words a user can act on."""
