"""The integrations' one error: a framework setting the scheduler cannot run under."""

from __future__ import annotations

from ..errors import AutoprecError

__all__ = ["IntegrationError"]


class IntegrationError(AutoprecError, ValueError):
    """A Trainer setting that cannot be combined with autoprec's scheduler (a second precision
    manager, manual optimization, a wrapped model, ...); the message names the setting and the fix."""
