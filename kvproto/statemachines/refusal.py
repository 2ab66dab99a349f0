"""The effect every machine shares: an event that was refused and changed nothing."""

from __future__ import annotations

import attrs

from kvproto import errors


@attrs.frozen
class Refused:
    """The event was refused (or, for a callback, dropped) and changed nothing."""

    error: errors.KvError

    @property
    def code(self) -> int:
        return self.error.code


def refuse(state, error: errors.KvError):
    """``(state, (Refused(error),))``: the step that changes nothing."""
    return state, (Refused(error),)


def accepted(effects: tuple) -> bool:
    """Whether a step's effects say the event was accepted."""
    return not (effects and isinstance(effects[0], Refused))
