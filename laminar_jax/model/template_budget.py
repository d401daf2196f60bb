"""A time and output budget for rendering an untrusted Jinja chat template (chat_template.py).

jinja2's sandbox keeps a template from reaching Python internals, but not from looping for hours or
building a gigabyte string. Within a render:
  - time: a trace function on the template's own frames (compiled code named "<template>") checks
    the deadline at every template line, so nested loops stop however little they print. The
    deadline is in the rendering thread's CPU time: a runaway template burns CPU, while a benign one
    waiting for the GIL or a core on a loaded host must not fail (one row of a data file did, at 2 s
    of wall time, in a loaded test run);
  - output: the rendered chunks are counted as they stream out of the template;
  - single big values: `*`, `**` and `%`, the `~` join, and calls and filters given a number above
    the output budget (str.center(10**9), |indent(10**9)...) are refused before they allocate;
    a value a call returns above the budget is refused after.
A render past any of these raises BudgetExceeded; chat_template.render names the template file.
"""

from __future__ import annotations

import contextvars
import functools
import re
import sys
import time
from typing import Any, Callable, NamedTuple, Optional

TEMPLATE_FILENAME = "<template>"  # what jinja names the code it compiles from a string


class RenderBudget(NamedTuple):
    seconds: float = 2.0  # CPU seconds of the rendering thread
    chars: int = 2_000_000  # rendered characters (~500k tokens)


class BudgetExceeded(Exception):
    """A render went past its RenderBudget; the message says which limit."""


class Meter:
    """One render's budget: its deadline and its character limit."""

    def __init__(self, budget: RenderBudget):
        self.budget, self.deadline = budget, time.thread_time() + budget.seconds

    def check_time(self) -> None:
        if time.thread_time() > self.deadline:
            raise BudgetExceeded(f"ran longer than {self.budget.seconds} s of CPU time")

    def check_size(self, n: int, what: str) -> None:
        if n > self.budget.chars:
            raise BudgetExceeded(f"{what} of {n} > {self.budget.chars} characters")

    def tracer(self, frame, event, arg):
        """sys.settrace hook: only template frames are traced, at every line."""
        if frame.f_code.co_filename != TEMPLATE_FILENAME:
            return None
        self.check_time()
        return self._line

    def _line(self, frame, event, arg):
        if event == "line":
            self.check_time()
        return self._line


_CURRENT: contextvars.ContextVar[Optional[Meter]] = contextvars.ContextVar("chat_template_meter", default=None)
_DEFAULT = RenderBudget()


def meter() -> Meter:
    """The running render's meter (a fresh default one outside a budgeted render)."""
    m = _CURRENT.get()
    return m if m is not None else Meter(_DEFAULT)


def run_budgeted(budget: RenderBudget, chunks: Callable[[], Any]) -> str:
    """Join the chunks that `chunks()` yields, within `budget` (raises BudgetExceeded)."""
    m = Meter(budget)
    token = _CURRENT.set(m)
    previous = sys.gettrace()
    sys.settrace(m.tracer)
    try:
        out, n = [], 0
        for chunk in chunks():
            n += len(chunk)
            m.check_size(n, "output")
            m.check_time()
            out.append(chunk)
        return "".join(out)
    except RecursionError:
        raise BudgetExceeded("recursed too deep") from None
    except MemoryError:
        raise BudgetExceeded("ran out of memory") from None
    finally:
        sys.settrace(previous)
        _CURRENT.reset(token)


def _seq_len(x: Any) -> Optional[int]:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else None


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse `left <operator> right` when its result would pass the budget."""
    m = meter()
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if _seq_len(seq) is not None and isinstance(n, int):
                m.check_size(_seq_len(seq) * max(n, 0), "a repeated value")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
        m.check_size(int(right * abs(left).bit_length() / 3.3), "a power's digits")
    elif operator == "%" and isinstance(left, str):
        check_format(left)


# The widths and precisions of %-formats and {}-formats: what makes a format allocate.
_WIDTHS = re.compile(r"%[-+ #0]*(\d*)(?:\.(\d+))?[a-zA-Z]|\{[^{}]*:[^{}\d]*(\d+)(?:\.(\d+))?[^{}]*\}")


def check_format(fmt: str) -> None:
    """Refuse a format string with a width or precision above the budget ('%999999999d', '{:>999999999}')."""
    m = meter()
    for groups in _WIDTHS.findall(fmt):
        for digits in groups:
            if digits:
                m.check_size(int(digits[:13]), "a format width")


def check_args(args, kwargs: dict) -> None:
    """Refuse a call given a number above the budget (a width, a count)."""
    m = meter()
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool):
            m.check_size(a, "a call's numeric argument")


def check_call(obj: Any, args: tuple, kwargs: dict) -> None:
    """Before a call from a template: its numbers, and the format string when it is str.format."""
    check_args(args, kwargs)
    bound = getattr(getattr(obj, "__wrapped__", obj), "__self__", None)  # jinja wraps str.format
    if isinstance(bound, str) and getattr(obj, "__name__", "") in ("format", "format_map"):
        check_format(bound)


def check_result(value: Any) -> Any:
    n = _seq_len(value)
    if n is not None:
        meter().check_size(n, "a value")
    return value


def budget_join(parts) -> str:
    """The `~` operator (jinja's str_join) with the combined length checked first."""
    parts = [p if isinstance(p, str) else str(p) for p in parts]
    meter().check_size(sum(map(len, parts)), "a joined string")
    return "".join(parts)


def guard_filter(f: Callable) -> Callable:
    """A filter that refuses numbers above the budget and results past it (keeps jinja's pass_* marks)."""
    skip = 2 if hasattr(f, "jinja_pass_arg") else 1  # the context/environment, then the filtered value

    @functools.wraps(f)
    def guarded(*args, **kwargs):
        check_args(args[skip:], kwargs)
        if f.__name__ == "do_format" and args and isinstance(args[0], str):
            check_format(args[0])
        return check_result(f(*args, **kwargs))

    return guarded
