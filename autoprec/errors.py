"""The exception hierarchy: every error autoprec raises on purpose is an `AutoprecError`.

Each class also subclasses the builtin that fits, so callers that already catch `ValueError`
or `RuntimeError` keep working (Optuna's exceptions do the same).
"""


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name when the message is empty): the
    one line a log or another error quotes of it."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class AutoprecError(Exception):
    """Root of autoprec's errors."""


class ProblemsError(AutoprecError, ValueError):
    """An error that lists every problem found (``.problems``), one per line, and what to do.

    ``artifact`` names what was invalid ("plan", "profile"). A single problem with no hint is
    the message itself when ``single_line`` is set (on the class, or for one error).
    """

    artifact = "input"
    single_line = False

    def __init__(self, problems, hint: str = "", *, single_line: "bool | None" = None):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        single_line = self.single_line if single_line is None else single_line
        if single_line and len(self.problems) == 1 and not hint:
            message = self.problems[0]
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            count = len(self.problems)
            message = f"invalid {self.artifact} ({count} problem{'s' if count != 1 else ''}):\n{lines}"
        if hint:
            message += f"\n{hint}"
        super().__init__(message)


class PlanError(ProblemsError):
    """A plan is malformed or does not fit the model or the device.

    The message names every offending entry and says what to do.
    """

    artifact = "plan"


class RuntimeStateError(AutoprecError, RuntimeError):
    """A precision context was used wrongly (re-entered while active, exited twice, ...), given
    something other than a module or a `Plan`, or handed a state dict it cannot restore; the
    message names the argument or field and the fix."""


class DistributedError(AutoprecError, RuntimeError):
    """Ranks of a process group disagree (plan, settings) or a setup cannot run distributed."""


class FormatError(AutoprecError, ValueError):
    """An unknown format name or a quantization request the format cannot serve."""


class SettingsError(AutoprecError, ValueError):
    """A setting a caller gave cannot be used: a keyword argument (`SchedulerConfig`,
    `Thresholds`, a Trainer integration's), a benchmark field. One line naming the setting and
    the fix."""


class SearchError(AutoprecError, ValueError):
    """A search cannot run as configured: an empty space, a bad rule, a bad budget."""


class InfeasibleBudgetError(SearchError):
    """No plan meets the budgets; the message states the smallest memory and loss increase
    reachable. ``formats_floor``: the least bytes of any plan recomputing no block;
    ``recompute_floor``: the least with recomputation (None when the search had no block to
    recompute); both None when the memory budget was not the one missed. ``fp32_bytes``: the
    FP32 plan's bytes, once the message states the budgets as fractions of them."""

    def __init__(self, message: str, min_bytes: float, min_loss: float, *, formats_floor: "float | None" = None,
                 recompute_floor: "float | None" = None, fp32_bytes: "float | None" = None):
        super().__init__(message)
        self.min_bytes = min_bytes
        self.min_loss = min_loss
        self.formats_floor = formats_floor
        self.recompute_floor = recompute_floor
        self.fp32_bytes = fp32_bytes

    def with_hint(self, hint: str) -> "InfeasibleBudgetError":
        """This error with a hint appended to its message; the figures are kept.

        Args:
            hint: the settings that would reach a floor, appended after ``"; "`` (empty: the
                message unchanged).

        Returns:
            A new `InfeasibleBudgetError` (to raise in place of this one).
        """
        return InfeasibleBudgetError(f"{self}; {hint}" if hint else str(self), self.min_bytes, self.min_loss, formats_floor=self.formats_floor,
                                     recompute_floor=self.recompute_floor, fp32_bytes=self.fp32_bytes)


class SensitivityError(AutoprecError, ValueError):
    """A sensitivity estimate or measurement was asked for with inputs it cannot use (no batches,
    unknown layers or formats, a loss that is not a finite scalar, mismatched rankings)."""


class ProfileError(ProblemsError):
    """A profile is malformed, was made for another model, or a profiler was misused.

    The message names every offending layer or field and says what to do.
    """

    artifact = "profile"
    single_line = True


class CostModelError(AutoprecError, ValueError):
    """The cost model cannot cost what it was asked: an unknown layer or format, a plan that does
    not match the traced model, a bad measurement setting. The message says what to pass instead."""


class MonitoringError(AutoprecError, ValueError):
    """TensorBoard output cannot be written or served: an unwritable logdir, a bad run name, a
    TensorBoard server that does not start. The message is one line saying what to do."""


class ScalingError(AutoprecError, ValueError):
    """A loss scaler or output watch was configured with a value it cannot use (a bad factor, an
    unknown layer, a malformed state dict). The message names the argument and what it expects."""


class ModelCallError(AutoprecError, ValueError):
    """A model call cannot be captured or replayed as given, or its output holds no loss. The
    message names what was passed and what to pass instead."""


class WorkloadError(AutoprecError, ValueError):
    """A workload spec that cannot be imported or called, or an object that is not a workload
    (`autoprec.workload`). The message says what failed and the fix."""


class UserCodeError(AutoprecError, RuntimeError):
    """The user's own code (a workload hook, a model's forward) raised. The message names the hook
    and what it raised; the original exception is ``__cause__``, whose traceback the CLI shows
    trimmed to the user's own frames (all of it with ``--debug`` or ``AUTOPREC_DEBUG=1``)."""

    def __init__(self, message: str, hook: str = ""):
        super().__init__(message)
        self.hook = hook


class BenchConfigError(SettingsError):
    """A `BenchConfig` field (or the device it names) cannot be benchmarked; the message says why."""


class OpCountError(AutoprecError, ValueError):
    """A counting helper (`autoprec.opcount`) was called with an argument it cannot use; the
    message names it."""


class GpuBenchError(AutoprecError, ValueError):
    """The GPU suite (`autoprec.bench.gpu`) cannot run as asked (no CUDA device without
    ``smoke``, a bad device name)."""


class IntegrationError(SettingsError):
    """A Trainer setting that cannot be combined with autoprec's scheduler (a second precision
    manager, manual optimization, a wrapped model, ...); the message names the setting and the fix."""
