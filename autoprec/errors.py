"""The exception hierarchy: every error autoprec raises on purpose is an `AutoprecError`.

Each class also subclasses the builtin that fits, so callers that already catch `ValueError`
or `RuntimeError` keep working (Optuna's exceptions do the same).
"""


class AutoprecError(Exception):
    """Root of autoprec's errors."""


class PlanError(AutoprecError, ValueError):
    """A plan is malformed or does not fit the model or the device.

    The message names every offending entry and says what to do.
    """

    def __init__(self, problems, hint: str = ""):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        message = f"invalid plan ({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}):\n{lines}"
        if hint:
            message += f"\n{hint}"
        super().__init__(message)


class RuntimeStateError(AutoprecError, RuntimeError):
    """A precision context was used wrongly (re-entered while active, exited twice, ...)."""


class FormatError(AutoprecError, ValueError):
    """An unknown format name or a quantization request the format cannot serve."""
