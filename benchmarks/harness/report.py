"""Writing a benchmark's report: the JSON, the markdown table and the plot next to each other.

``write_report()`` writes them; ``table()`` and ``fmt()`` build the markdown; ``front()`` picks
the time-memory Pareto front; ``reason()`` is how an exception reads in a report (a peer that
could not run, a row that failed).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Sequence


def slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "device"


def fmt(v, spec: str, missing: str = "") -> str:
    """``format(v, spec)``, or ``missing`` for None / NaN."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return missing
    return format(v, spec)


def finite(x) -> Optional[float]:
    """``float(x)``, or None for None / NaN / inf."""
    return None if x is None or not math.isfinite(x) else float(x)


def ratio(a, b) -> Optional[float]:
    """``a / b`` of two finite numbers with b > 0, else None."""
    if a is None or b is None or not math.isfinite(a) or not math.isfinite(b) or b <= 0:
        return None
    return a / b


def pct(x) -> str:
    """``12.3%`` for 0.123; ``n/a`` for None."""
    return "n/a" if x is None else f"{100 * x:.1f}%"


def table(header: Sequence[str], rows: Iterable[Sequence], align: Optional[str] = None) -> List[str]:
    """Markdown table lines; ``align``: one character per column, ``l``, ``r`` or ``c``."""
    align = align or "l" * len(header)
    rule = "|" + "|".join({"r": "---:", "c": ":---:"}.get(a, "---") for a in align) + "|"
    return (["| " + " | ".join(header) + " |", rule]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def write_report(stem: Path, report: dict, markdown: Optional[str] = None,
                 plot: Optional[Callable[[dict, Path], None]] = None) -> List[Path]:
    """``stem.json`` (the report), ``stem.md`` (``markdown``) and ``stem.png`` (``plot``, when
    matplotlib is importable; a failing plot never loses the numbers: it is noted in the
    report's ``notes``). Returns the paths written."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    written = []
    if plot is not None:
        png = stem.with_name(stem.name + ".png")
        try:
            plot(report, png)
            if png.exists():
                written.append(png)
        except ImportError as e:  # matplotlib is optional
            _note(report, "plot", f"no plot: {e}")
        except Exception as e:  # noqa: BLE001
            _note(report, "plot", f"plot failed: {type(e).__name__}: {e}")
    path = stem.with_name(stem.name + ".json")
    path.write_text(json.dumps(report, indent=1))
    written.insert(0, path)
    if markdown is not None:
        path = stem.with_name(stem.name + ".md")
        path.write_text(markdown if markdown.endswith("\n") else markdown + "\n")
        written.insert(1, path)
    return written


def _note(report: dict, key: str, text: str) -> None:
    notes = report.setdefault("notes", {})
    if isinstance(notes, dict):
        notes[key] = text
    else:
        notes.append(f"{key}: {text}")


def front(rows: Sequence[dict], cost: str, time: str) -> List[dict]:
    """The rows on the ``time``-``cost`` Pareto front (none other is both faster and leaner),
    leanest first."""
    out, best = [], None
    for r in sorted(rows, key=lambda r: (r[cost], r[time])):
        if best is None or r[time] < best:
            out.append(r)
            best = r[time]
    return out


def reason(exc: BaseException, first_line: bool = False) -> str:
    """``Type: message`` (only the message's first line with ``first_line``)."""
    text = str(exc)
    if first_line:
        text = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {text}"
