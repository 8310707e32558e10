"""Plots as plain inline SVG strings: axes, ticks, labels, log scales. No plotting library, no script.

Each chart function returns one `<svg>` element that an HTML page can embed
as is; every text is escaped, every number is formatted here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

# Colours: Okabe-Ito, readable by colour-blind readers and in print.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
AXIS_COLOUR = "#444"
GRID_COLOUR = "#e3e3e3"
FONT = 'font-family="system-ui, sans-serif" font-size="11"'


def format_number(value: float) -> str:
    """Compact tick labels: 3 significant digits, no trailing zeros, k/M suffixes for large values.

    >>> [format_number(v) for v in (0.000123, 0.5, 12.0, 1500.0, 2.5e6)]
    ['0.000123', '0.5', '12', '1.5k', '2.5M']
    """
    if value == 0:
        return "0"
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}"


def linear_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round tick values covering [lo, hi].

    >>> linear_ticks(0, 1)
    [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    """
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.floor(lo / step)
    return [round(float(i * step), 12) for i in range(first, math.ceil(hi / step - 1e-9) + 1)]


def log_ticks(lo: float, hi: float) -> list[float]:
    """Decades covering [lo, hi]; 2 and 5 in between when the range spans two decades or less.

    >>> log_ticks(0.3, 40)
    [0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]
    """
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    steps = (1, 2, 5) if last - first <= 3 else (1,)
    ticks = [m * 10.0 ** e for e in range(first, last + 1) for m in steps]
    return [round(t, 12) for t in ticks if t <= 10.0 ** last * 1.0000001]


@dataclass(frozen=True)
class Axis:
    """Maps data values onto pixels along one direction."""

    lo: float
    hi: float
    start: float  # pixel of lo
    end: float  # pixel of hi
    log: bool = False

    def __call__(self, value: float) -> float:
        if self.log:
            a, b, v = math.log10(self.lo), math.log10(self.hi), math.log10(max(value, 1e-300))
        else:
            a, b, v = self.lo, self.hi, value
        fraction = 0.0 if b == a else (v - a) / (b - a)
        return self.start + fraction * (self.end - self.start)

    def ticks(self) -> list[float]:
        values = log_ticks(self.lo, self.hi) if self.log else linear_ticks(self.lo, self.hi)
        slack = 1e-9 * (self.hi - self.lo)
        return [v for v in values if self.lo - slack <= v <= self.hi + slack]


def axis_for(values: list[float], start: float, end: float, log: bool = False, include_zero: bool = False) -> Axis:
    """An axis whose range covers `values` with round ends.

    >>> a = axis_for([3.0, 7.0], 0, 100, include_zero=True); (a.lo, a.hi)
    (0.0, 8.0)
    """
    finite = [v for v in values if v is not None and math.isfinite(v) and (v > 0 or not log)]
    if not finite:
        finite = [1.0]
    lo, hi = min(finite), max(finite)
    if log:
        lo, hi = 10 ** math.floor(math.log10(lo)), 10 ** math.ceil(math.log10(hi))
        if lo == hi:
            lo, hi = lo / 10, hi * 10
        return Axis(lo, hi, start, end, log=True)
    if include_zero:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    if lo == hi:
        lo, hi = lo - (abs(lo) or 1) * 0.1, hi + (abs(hi) or 1) * 0.1
    ticks = linear_ticks(lo, hi)
    return Axis(ticks[0], ticks[-1], start, end)


class Canvas:
    """An SVG document built element by element."""

    def __init__(self, width: int, height: int, title: str):
        self.width, self.height, self.title = width, height, title
        self.parts: list[str] = []

    def add(self, element: str) -> None:
        self.parts.append(element)

    def text(self, x: float, y: float, content: str, anchor: str = "middle", size: int = 11, rotate: bool = False,
             colour: str = AXIS_COLOUR, weight: str = "normal") -> None:
        transform = f' transform="rotate(-90 {x:.1f} {y:.1f})"' if rotate else ""
        self.add(f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" fill="{colour}" '
                 f'font-weight="{weight}"{transform}>{escape(content)}</text>')

    def line(self, x1: float, y1: float, x2: float, y2: float, colour: str = AXIS_COLOUR, width: float = 1.0,
             dash: str = "") -> None:
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        self.add(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{colour}" '
                 f'stroke-width="{width}"{dashed}/>')

    def render(self) -> str:
        body = "\n".join(self.parts)
        return (f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" width="{self.width}" height="{self.height}" '
                f'viewBox="0 0 {self.width} {self.height}" role="img" aria-label="{escape(self.title)}" {FONT}>\n'
                f'<title>{escape(self.title)}</title>\n<rect width="100%" height="100%" fill="white"/>\n{body}\n</svg>')


def _frame(canvas: Canvas, x: Axis, y: Axis, x_label: str, y_label: str) -> None:
    """Grid, axes, ticks and axis labels of a plot area."""
    top, bottom, left, right = y.end, y.start, x.start, x.end
    for value in y.ticks():
        py = y(value)
        canvas.line(left, py, right, py, GRID_COLOUR)
        canvas.text(left - 6, py + 4, format_number(value), anchor="end")
    for value in x.ticks():
        px = x(value)
        canvas.line(px, top, px, bottom, GRID_COLOUR)
        canvas.text(px, bottom + 15, format_number(value))
    canvas.line(left, bottom, right, bottom)
    canvas.line(left, top, left, bottom)
    canvas.text((left + right) / 2, bottom + 32, x_label)
    canvas.text(14, (top + bottom) / 2, y_label, rotate=True)


def convergence_chart(points: list[tuple[int, str, float | None, float | None]], title: str,
                      unit_label: str = "median time (ms)", width: int = 460, height: int = 260,
                      x_label: str = "evaluated trials") -> str:
    """Best-so-far against trials evaluated: (trials evaluated so far, status, median_ms or None,
    best_so_far_ms or None) per trial.

    Passing trials are grey dots, the best so far a blue step line, failed trials red ticks on the axis.

    >>> svg = convergence_chart([(0, "ok", 2.0, 2.0), (1, "crash", None, 2.0), (2, "ok", 1.0, 1.0)], "gemm")
    >>> svg.startswith("<svg") and svg.count("<circle") == 2
    True
    """
    canvas = Canvas(width, height, title)
    canvas.text(width / 2, 16, title, size=12, weight="bold")
    numbers = [p[0] for p in points] or [0]
    times = [p[2] for p in points if p[2] is not None]
    x = axis_for(numbers, 64, width - 16, include_zero=True)
    spread = max(times) / min(times) if times else 1.0
    y = axis_for(times, height - 48, 28, log=spread > 20, include_zero=spread <= 20)
    _frame(canvas, x, y, x_label, unit_label)
    for number, status, median, _best in points:
        if median is not None:
            canvas.add(f'<circle cx="{x(number):.1f}" cy="{y(median):.1f}" r="3" fill="#9a9a9a">'
                       f'<title>trial {number}: {median:.4g} ms</title></circle>')
        elif status != "ok":
            px = x(number)
            canvas.add(f'<line x1="{px:.1f}" y1="{y.start - 7:.1f}" x2="{px:.1f}" y2="{y.start:.1f}" '
                       f'stroke="#D55E00" stroke-width="2"><title>trial {number}: {escape(status)}</title></line>')
    steps, previous = [], None
    for number, _status, _median, best in points:
        if best is None:
            continue
        if previous is not None:
            steps.append(f"{x(number):.1f},{y(previous):.1f}")
        steps.append(f"{x(number):.1f},{y(best):.1f}")
        previous = best
    if steps:
        canvas.add(f'<polyline class="best-so-far" points="{" ".join(steps)}" fill="none" stroke="{PALETTE[0]}" '
                   'stroke-width="2"/>')
    return canvas.render()


@dataclass(frozen=True)
class RooflinePoint:
    label: str
    intensity: float  # FLOPs per byte
    tflops: float
    group: str  # legend entry (the family)


def roofline_chart(points: list[RooflinePoint], peak_tflops: dict[str, float], copy_tbps: float, title: str,
                   width: int = 760, height: int = 440) -> str:
    """Log-log roofline: the bandwidth roof (copy_tbps x intensity), a flat roof per compute peak, each point.

    >>> svg = roofline_chart([RooflinePoint("a", 300.0, 500.0, "gemm")], {"bf16": 717.0}, 4.3, "h200")
    >>> "bf16 peak 717 TFLOP/s" in svg and svg.count('class="point"') == 1
    True
    """
    canvas = Canvas(width, height, title)
    canvas.text(width / 2, 16, title, size=12, weight="bold")
    peaks = sorted(peak_tflops.items(), key=lambda kv: -kv[1])
    intensities = [p.intensity for p in points if p.intensity > 0]
    ridge = [peak / copy_tbps for _, peak in peaks] if copy_tbps else []
    x = axis_for(intensities + ridge + [min(intensities + ridge, default=1.0) / 4], 70, width - 170, log=True)
    values = [p.tflops for p in points if p.tflops > 0] + [peak for _, peak in peaks]
    if copy_tbps:  # the bandwidth roof from the left edge, and to the right edge when no flat roof stops it
        values += [copy_tbps * x.lo] + ([] if peaks else [copy_tbps * x.hi])
    y = axis_for(values, height - 50, 28, log=True)
    _frame(canvas, x, y, "arithmetic intensity (FLOP/byte)", "TFLOP/s")
    top = max((peak for _, peak in peaks), default=y.hi)
    if copy_tbps:
        end = min(top / copy_tbps, x.hi)
        canvas.line(x(x.lo), y(copy_tbps * x.lo), x(end), y(copy_tbps * end), AXIS_COLOUR, 2)
        if not peaks:
            canvas.line(x(end), y(copy_tbps * end), x(x.hi), y(copy_tbps * x.hi), AXIS_COLOUR, 2)
        canvas.text(x(x.lo) + 8, y(copy_tbps * x.lo) - 8, f"copy {copy_tbps:g} TB/s", anchor="start")
    for dtype, peak in peaks:
        start = peak / copy_tbps if copy_tbps else x.lo
        dash = "" if peak == top else "6 4"
        canvas.line(x(max(start, x.lo)), y(peak), x(x.hi), y(peak), AXIS_COLOUR, 1.5, dash)
        canvas.text(x(x.hi) + 4, y(peak) + 4, f"{dtype} peak {peak:g} TFLOP/s", anchor="start", size=10)
    groups = sorted({p.group for p in points})
    colour = {g: PALETTE[i % len(PALETTE)] for i, g in enumerate(groups)}
    for point in points:
        if point.intensity <= 0 or point.tflops <= 0:
            continue
        canvas.add(f'<circle class="point" cx="{x(point.intensity):.1f}" cy="{y(point.tflops):.1f}" r="4.5" '
                   f'fill="{colour[point.group]}" fill-opacity="0.85" stroke="white">'
                   f'<title>{escape(point.group)} {escape(point.label)}: {point.tflops:.3g} TFLOP/s at '
                   f'{point.intensity:.3g} FLOP/byte</title></circle>')
    for i, group in enumerate(groups):  # legend, bottom right, below the roof labels
        lx, ly = x.end + 10, height - 60 - 16 * (len(groups) - 1 - i)
        canvas.add(f'<circle cx="{lx:.1f}" cy="{ly:.1f}" r="4.5" fill="{colour[group]}"/>')
        canvas.text(lx + 9, ly + 4, group, anchor="start")
    return canvas.render()


def bar_chart(bars: list[tuple[str, float]], title: str, value_label: str, reference: float | None = None,
              log: bool = False, width: int = 760, bar_height: int = 18, label_width: int = 300) -> str:
    """Horizontal bars, one per (label, value), top to bottom; an optional dashed reference line (e.g. 1x).

    >>> svg = bar_chart([("BLOCK_M", 0.6), ("num_warps", 0.4)], "importance", "share")
    >>> svg.count('class="bar"')
    2
    """
    height = 60 + bar_height * max(len(bars), 1) + 36
    canvas = Canvas(width, height, title)
    canvas.text(width / 2, 16, title, size=12, weight="bold")
    values = [v for _, v in bars] + ([reference] if reference else [])
    top, bottom = 30, 30 + bar_height * max(len(bars), 1)
    x = axis_for(values, label_width, width - 60, log=log, include_zero=not log)
    y = Axis(0, max(len(bars), 1), top, bottom)
    for value in x.ticks():
        px = x(value)
        canvas.line(px, top, px, bottom, GRID_COLOUR)
        canvas.text(px, bottom + 15, format_number(value))
    canvas.line(x.start, top, x.start, bottom)
    canvas.line(x.start, bottom, x.end, bottom)
    canvas.text((x.start + x.end) / 2, bottom + 32, value_label)
    origin_px = x(x.lo) if log else x(0.0)
    for i, (label, value) in enumerate(bars):
        py = y(i) + 3
        end = x(value) if value > 0 or not log else origin_px
        left, span = min(origin_px, end), abs(end - origin_px)
        fill = PALETTE[0] if reference is None or value >= reference else PALETTE[3]
        canvas.add(f'<rect class="bar" x="{left:.1f}" y="{py:.1f}" width="{max(span, 1):.1f}" '
                   f'height="{bar_height - 6}" fill="{fill}"><title>{escape(label)}: {value:.4g}</title></rect>')
        fits = max(int((label_width - 12) / 7), 8)  # characters of 11 px text that fit left of the bars
        short = label if len(label) <= fits else label[: fits - 1] + "\u2026"
        canvas.text(x.start - 6, py + bar_height - 9, short, anchor="end")
        canvas.text(end + 4, py + bar_height - 9, f"{value:.3g}", anchor="start", size=10)
    if reference is not None:
        px = x(reference)
        canvas.line(px, top - 4, px, bottom, "#000", 1.2, "5 3")
        canvas.text(px, top - 6, format_number(reference) + "x", size=10)
    return canvas.render()
