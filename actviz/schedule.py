"""Schedules: on which steps to log. A schedule is data, checked when it is made."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Collection
from dataclasses import dataclass

__all__ = ["DEFAULT_IMAGE_PERIOD", "ScheduleSpec", "Schedule", "default_step", "logged_steps"]

#: ``every=`` and ``image_every=`` accept a period, explicit steps, a predicate, or ``False`` for never.
ScheduleSpec = int | Collection[int] | Callable[[int], bool]

#: The default schedule's phases, ``(steps below this, log every this many)``, then every :data:`SPARSE_PERIOD`.
DENSE_PHASES: tuple[tuple[int, int], ...] = ((10, 1), (1000, 10))
SPARSE_PERIOD = 100
#: Feature-map grids by default (``every=`` and ``image_every=`` both left out): every 100 steps, step 0 included.
#: Pictures are the dearest part of a logging step, so the dense start logs numbers and histograms only.
DEFAULT_IMAGE_PERIOD = 100


def default_step(step: int) -> bool:
    """Whether the default schedule logs ``step``: every step up to 9, every 10th up to 990, then every 100th.

    A 200-step run logs 29 steps (a curve, not two points); a long run logs one step in 100, as
    ``every=100`` does, and 99 more over its first 1,000 steps (1,099 steps over 100,000 against 1,000: 9.9 % more).

    Example:
        >>> [step for step in range(40) if default_step(step)]
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 20, 30]
        >>> default_step(990), default_step(1010), default_step(1100)
        (True, False, True)
    """
    for below, period in DENSE_PHASES:
        if step < below:
            return step % period == 0
    return step % SPARSE_PERIOD == 0


def logged_steps(schedule: Callable[[int], bool], steps: int) -> int:
    """How many of the steps ``0 .. steps - 1`` ``schedule`` logs.

    Example:
        >>> logged_steps(default_step, 100_000), logged_steps(Schedule.parse(100), 100_000)
        (1099, 1000)
    """
    return sum(1 for step in range(steps) if schedule(step))


def _is_int(value: object) -> bool:
    """A Python int or a NumPy integer (``np.int64`` from ``np.arange``), not a bool.

    Example:
        >>> import numpy as np
        >>> _is_int(3), _is_int(np.int64(3)), _is_int(True), _is_int(3.0)
        (True, True, False, False)
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class Schedule:
    """Decides whether a step logs.

    Build one with :meth:`Schedule.parse`. Exactly one field is set, or none: never.

    Example:
        >>> [s for s in range(10) if Schedule.parse(4)(s)]
        [0, 4, 8]
        >>> [s for s in range(10) if Schedule.parse([1, 5])(s)]
        [1, 5]
        >>> [s for s in range(10) if Schedule.parse(lambda s: s in (0, 1) or s % 5 == 0)(s)]
        [0, 1, 5]
        >>> [s for s in range(10) if Schedule.parse(False)(s)]
        []
    """

    period: int | None = None
    steps: frozenset[int] | range | None = None
    predicate: Callable[[int], bool] | None = None

    @classmethod
    def default(cls) -> Schedule:
        """The schedule of ``every=`` left out: dense at first, then every 100 steps (:func:`default_step`).

        Example:
            >>> Schedule.default().describe()
            'steps 0-9, every 10 up to 990, then every 100'
        """
        return cls(predicate=default_step)

    def describe(self) -> str:
        """The schedule in words, for messages.

        Example:
            >>> Schedule.parse(50).describe(), Schedule.parse([3, 1]).describe(), Schedule.parse(False).describe()
            ('every 50 steps', 'steps 1, 3', 'never')
            >>> Schedule.parse(range(0, 10**15, 7)).describe()
            'steps 0, 7, 14, 21, 28, ...'
        """
        if self.period is not None:
            return f"every {self.period} steps"
        if isinstance(self.steps, range):  # of any length: not sorted
            shown = self.steps if self.steps.step > 0 else self.steps[::-1]
            return "steps " + ", ".join(str(step) for step in shown[:5]) + (", ..." if len(shown) > 5 else "")
        if self.steps is not None:
            first = sorted(self.steps)[:5]
            return "steps " + ", ".join(str(step) for step in first) + (", ..." if len(self.steps) > 5 else "")
        if self.predicate is default_step:
            return "steps 0-9, every 10 up to 990, then every 100"
        return "a predicate" if self.predicate is not None else "never"

    @classmethod
    def parse(cls, spec: ScheduleSpec, name: str = "every") -> Schedule:
        """Check ``spec`` and make a schedule of it.

        Args:
            spec: A positive ``int`` period (step 0 logs, then every ``spec`` steps), a collection of
                non-negative ``int`` step numbers (a ``range`` of any length is kept as a range), a
                predicate ``step -> bool``, or ``False`` for never. Not a tensor or an array.
            name: The argument's name, used in error messages.

        Raises:
            ValueError: A period ≤ 0, a negative or empty list of steps.
            TypeError: Anything else, a tensor or an array included (``every=int(t)`` or ``t.tolist()``).
        """
        if spec is False:
            return cls()  # never
        if spec is True:
            raise TypeError(f"{name}=True is ambiguous; give a number of steps, for example {name}=100 "
                            f"(or {name}=False to log none)")
        if _is_int(spec):  # a NumPy integer too
            spec = int(spec)  # type: ignore[call-overload]
        if hasattr(spec, "tolist") and hasattr(spec, "ndim"):  # a tensor or an array: whose numbers, on which device?
            example = f"{name}={spec.tolist()}" if getattr(spec, "ndim", 1) == 0 else f"{name}=steps.tolist()"
            raise TypeError(f"{name} must be a Python int or a collection of ints, got a {type(spec).__name__}: "
                            f"{spec!r}; for example {example}")
        if _is_int(spec):
            if spec <= 0:
                raise ValueError(f"{name} must be a positive number of steps, got {spec}; for example {name}=100")
            return cls(period=spec)
        if isinstance(spec, range):  # kept as a range: range(0, 10**12, 100) costs no memory
            if not spec:
                raise ValueError(f"{name} is an empty range of steps; nothing would be logged; for example "
                                 f"{name}=range(0, 1000, 10)")
            if min(spec[0], spec[-1]) < 0:
                raise ValueError(f"{name} steps must be non-negative integers, got {spec!r}; for example "
                                 f"{name}=range(0, 1000, 10)")
            return cls(steps=spec)
        if isinstance(spec, Collection) and not isinstance(spec, (str, bytes)):
            steps = list(spec)
            bad = [s for s in steps if not _is_int(s) or s < 0]
            if bad:
                raise ValueError(f"{name} steps must be non-negative integers, got {bad[0]!r}; for example "
                                 f"{name}=[0, 10, 100]")
            if not steps:
                raise ValueError(f"{name} is an empty collection of steps; nothing would be logged; for example "
                                 f"{name}=[0, 10, 100]")
            return cls(steps=frozenset(int(step) for step in steps))
        if callable(spec):
            return cls(predicate=spec)
        raise TypeError(
            f"{name} must be an int, a collection of step numbers, a function step -> bool or False "
            f"(never), got {type(spec).__name__}: {spec!r}"
        )

    def __call__(self, step: int) -> bool:
        if self.period is not None:
            return step % self.period == 0
        if self.steps is not None:
            return step in self.steps
        if self.predicate is not None:
            return bool(self.predicate(step))
        return False

    @property
    def never(self) -> bool:
        """True for ``False``: no step logs."""
        return self.period is None and self.steps is None and self.predicate is None
