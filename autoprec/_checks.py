"""The rules a setting's value is checked by, the same wherever it is given: a constructor's
keyword (`Scaling`, `Calibration`, `CommSettings`, `Thresholds`, `SchedulerConfig`) or a job
file's key (`job.config`).

- A **count** (an integer setting) is an ``int`` or a numpy integer scalar (held as ``int``, so
  that a plan or a config saves it as JSON). Refused: a bool (``chunk=True`` is not 1), a float,
  even an integral one (``history_len=8.0``: a count computed as a float is refused rather than
  rounded, as ``range(8.0)`` refuses it), and a string (``"256"`` read from a config file).
- A **number** is an ``int``, a ``float`` or a numpy real scalar (held as ``float``), finite.
  Refused: a bool, a string (``topk_ratio="0.01"`` is not compared with 0), NaN and infinities.

A check returns the value as held or raises ``ValueError``; `check_fields` turns that into one
line naming the setting and what it expects, e.g. ``CommSettings(chunk=2.5): expected an integer
>= 1 (values per scale)``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Mapping, Optional

from .errors import SettingsError

__all__ = ["integer", "number", "optional", "choice", "choices", "check_value", "check_fields"]

Check = Callable[[Any], Any]


def integer(low: Optional[int] = None, high: Optional[int] = None) -> Check:
    """A check of a count from ``low`` to ``high`` (either None: unbounded)."""

    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(value)
        value = int(value)
        if (low is not None and value < low) or (high is not None and value > high):
            raise ValueError(value)
        return value

    return check


def number(low: Optional[float] = None, high: Optional[float] = None, *, above: Optional[float] = None,
           below: Optional[float] = None) -> Check:
    """A check of a finite number ``>= low``, ``<= high``, ``> above``, ``< below`` (None: no bound)."""

    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(value)
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(value)
        if ((low is not None and value < low) or (high is not None and value > high)
                or (above is not None and value <= above) or (below is not None and value >= below)):
            raise ValueError(value)
        return value

    return check


def optional(check: Check) -> Check:
    """``check``, or None kept as None."""
    return lambda value: None if value is None else check(value)


def check_value(where: str, name: str, value: Any, check: Check, expected: str, error: type = SettingsError) -> Any:
    """``value`` as ``check`` holds it; else ``error`` with one line:
    ``{where}({name}={value!r}): expected {expected}``."""
    try:
        return check(value)
    except (ValueError, TypeError):
        raise error(f"{where}({name}={value!r}): expected {expected}") from None


def check_fields(obj: Any, where: str, rules: Mapping[str, "tuple[Check, str]"], error: type = SettingsError) -> None:
    """Check the fields of the frozen dataclass ``obj`` named in ``rules`` (name -> (check, what is
    expected)) and hold each as its check returns it; the first that fails raises ``error``
    (`check_value`)."""
    for name, (check, expected) in rules.items():
        object.__setattr__(obj, name, check_value(where, name, getattr(obj, name), check, expected, error))


def choice(options: Any) -> Check:
    """A check of one of ``options``, an enum class: a member or its value, held as the member."""

    def check(value: Any) -> Any:
        return options(value)

    return check


def choices(options: Any) -> str:
    """``options`` (an enum class) as an error says them: "'a', 'b' or 'c'"."""
    names = [repr(getattr(o, "value", o)) for o in options]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
