"""Small inline-SVG charts for the run report: line plots (with marker series) and stacked bars.

No dependencies. Every chart has a title, a subtitle (the metric keys), axes with tick labels and a legend.
Missing values (None, NaN) leave gaps; a chart with no data at all says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"]
WIDTH_PX, HEIGHT_PX = 520, 290
LEFT_PX, RIGHT_PX, BOTTOM_PX = 58, 18, 38
CHAR_PX = 6.4  # rough width of one 11px character, for laying out the legend
DOTS_MAX_POINTS = 60  # draw a dot per point up to this many points


@dataclass
class Series:
    """One named series of (x, y) points; y None or NaN is a gap. `markers_only` draws dots and a dashed line."""

    name: str
    xs: list[float]
    ys: list[float | None]
    markers_only: bool = False
    colour: str = ""

    def finite(self) -> list[tuple[float, float]]:
        return [(x, y) for x, y in zip(self.xs, self.ys) if _ok(y)]


@dataclass
class Frame:
    """Maps data coordinates to pixels inside the plot area."""

    x_lo: float
    x_hi: float
    y_lo: float
    y_hi: float
    top_px: float
    log_y: bool = False
    width_px: float = WIDTH_PX
    height_px: float = HEIGHT_PX
    x_ticks: list[float] = field(default_factory=list)
    y_ticks: list[float] = field(default_factory=list)

    @property
    def plot_w(self) -> float:
        return self.width_px - LEFT_PX - RIGHT_PX

    @property
    def bottom_y(self) -> float:
        return self.height_px - BOTTOM_PX

    def px(self, x: float) -> float:
        return LEFT_PX + (x - self.x_lo) / (self.x_hi - self.x_lo) * self.plot_w

    def py(self, y: float) -> float:
        lo, hi, v = self.y_lo, self.y_hi, y
        if self.log_y:
            lo, hi, v = math.log10(lo), math.log10(hi), math.log10(y)
        return self.bottom_y - (v - lo) / (hi - lo) * (self.bottom_y - self.top_px)


def _ok(y: float | None) -> bool:
    return isinstance(y, (int, float)) and not isinstance(y, bool) and math.isfinite(y)


def nice_step(span: float, target: int) -> float:
    """A 1/2/5 x 10^k step that cuts `span` into about `target` intervals."""
    raw = span / max(target, 1)
    power = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        if raw <= mult * power * 1.0001:
            return mult * power
    return 10 * power


def linear_ticks(lo: float, hi: float, target: int = 5, *, integer: bool = False) -> tuple[float, float, list[float]]:
    """Ticks covering [lo, hi]; returns the domain widened to whole ticks, and the ticks."""
    if hi - lo <= 0:  # one value: a constant 0 shows on [0, 1], others get 10% either side
        pad = abs(lo) * 0.1
        lo, hi = (0.0, 1.0) if pad == 0 else (lo - pad, hi + pad)
    step = nice_step(hi - lo, target)
    if integer:
        step = max(1.0, round(step))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    ticks = [float(f"{k * step:.12g}") for k in range(first, last + 1)]
    return ticks[0], ticks[-1], ticks


def log_ticks(lo: float, hi: float) -> tuple[float, float, list[float]]:
    """Decade ticks covering [lo, hi] (both > 0)."""
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    last = max(last, first + 1)
    ticks = [10.0**k for k in range(first, last + 1)]
    return ticks[0], ticks[-1], ticks


def fmt_num(value: float, step: float | None = None) -> str:
    """Short label for a number: `12k`, `0.25`, `3e-7`; `step` (tick spacing) sets the decimals."""
    a = abs(value)
    if a >= 1e6:
        return f"{value / 1e6:.3g}M"
    if a >= 1e4:
        return f"{value / 1e3:.3g}k"
    if value == 0:
        return "0"
    if step is not None and step >= 1e-3:
        decimals = max(0, -math.floor(math.log10(step) + 1e-9))
        return f"{value:.{decimals}f}"
    if a < 1e-3:  # 1.2e-07 -> 1.2e-7, 1.0e-04 -> 1e-4
        mant, exp = f"{value:.1e}".split("e")
        return f"{mant.removesuffix('.0')}e{int(exp)}"
    return f"{value:.3g}"


def _text(
    x: float, y: float, s: str, *, anchor: str = "middle", size: float = 11, fill: str = "#333", extra: str = ""
) -> str:
    """An SVG text element; `s` is escaped."""
    attrs = f'x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" fill="{fill}"{extra}'
    return f"<text {attrs}>{escape(s)}</text>"


def _header(title: str, subtitle: str) -> list[str]:
    return [
        _text(10, 19, title, anchor="start", size=14, fill="#111", extra=' font-weight="600"'),
        _text(10, 34, subtitle, anchor="start", size=10, fill="#777"),
    ]


def _legend(entries: list[tuple[str, str, str]], y0: float) -> tuple[list[str], float]:
    """Legend entries (name, colour, shape in line|dot|box) laid out in rows; returns svg parts and bottom y."""
    parts, x, y = [], float(LEFT_PX), y0
    for name, colour, shape in entries:
        width = 22 + len(name) * CHAR_PX + 14
        if x + width > WIDTH_PX - RIGHT_PX and x > LEFT_PX:
            x, y = float(LEFT_PX), y + 16
        if shape == "line":
            parts.append(f'<line x1="{x}" y1="{y}" x2="{x + 16}" y2="{y}" stroke="{colour}" stroke-width="2.5"/>')
        elif shape == "dot":
            parts.append(f'<circle cx="{x + 8}" cy="{y}" r="4" fill="{colour}" stroke="#fff"/>')
        else:
            parts.append(f'<rect x="{x + 2}" y="{y - 5}" width="11" height="10" fill="{colour}"/>')
        parts.append(_text(x + 21, y + 4, name, anchor="start"))
        x += width
    return parts, y + 10


def _axes(frame: Frame, x_label: str) -> list[str]:
    parts, right = [], frame.width_px - RIGHT_PX
    x_step = frame.x_ticks[1] - frame.x_ticks[0] if len(frame.x_ticks) > 1 else None
    y_step = frame.y_ticks[1] - frame.y_ticks[0] if len(frame.y_ticks) > 1 and not frame.log_y else None
    for t in frame.y_ticks:
        y = frame.py(t)
        parts.append(f'<line x1="{LEFT_PX}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#e6e6e6"/>')
        parts.append(_text(LEFT_PX - 6, y + 4, fmt_num(t, y_step), anchor="end", size=10, fill="#555"))
    for t in frame.x_ticks:
        x = frame.px(t)
        parts.append(f'<line x1="{x:.1f}" y1="{frame.bottom_y}" x2="{x:.1f}" y2="{frame.bottom_y + 4}" stroke="#888"/>')
        parts.append(_text(x, frame.bottom_y + 16, fmt_num(t, x_step), size=10, fill="#555"))
    parts.append(
        f'<polyline points="{LEFT_PX},{frame.top_px} {LEFT_PX},{frame.bottom_y} {right},{frame.bottom_y}" '
        'fill="none" stroke="#888"/>'
    )
    parts.append(_text(LEFT_PX + frame.plot_w / 2, frame.height_px - 6, x_label, size=10, fill="#555"))
    return parts


def _svg(title: str, parts: list[str]) -> str:
    body = "\n".join(parts)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH_PX} {HEIGHT_PX}" width="{WIDTH_PX}" '
        f'height="{HEIGHT_PX}" role="img" aria-label="{escape(title)}" font-family="system-ui, sans-serif">\n'
        f'<rect width="{WIDTH_PX}" height="{HEIGHT_PX}" fill="#fff"/>\n{body}\n</svg>'
    )


def empty_plot(title: str, subtitle: str) -> str:
    """A chart frame that says `no data`."""
    parts = _header(title, subtitle) + [_text(WIDTH_PX / 2, HEIGHT_PX / 2, "no data", size=14, fill="#999")]
    return _svg(title, parts)


def _use_log(values: list[float], log_y: bool | str) -> bool:
    if log_y != "auto":
        return bool(log_y)
    return bool(values) and min(values) > 0 and max(values) / min(values) >= 100


def moving_mean(ys: list[float | None], half_window: int) -> list[float | None]:
    """Centred mean over the valid values within `half_window` places; gaps stay gaps."""
    out: list[float | None] = []
    for i, y in enumerate(ys):
        near = [v for v in ys[max(0, i - half_window) : i + half_window + 1] if _ok(v)]
        out.append(sum(near) / len(near) if _ok(y) else None)  # type: ignore[arg-type]
    return out


def smoothing_half_window(n_points: int) -> int:
    """Half window of the moving mean drawn over long noisy series (0 = no smoothing)."""
    return 0 if n_points <= DOTS_MAX_POINTS else max(2, n_points // 50)


def _polylines(frame: Frame, xs: list[float], ys: list[float | None], colour: str, style: str) -> list[str]:
    """One polyline per run of drawable points; gaps split them."""
    parts, run = [], []
    for x, y in [*zip(xs, ys), (0.0, None)]:
        if _ok(y) and (not frame.log_y or y > 0):  # type: ignore[operator]
            run.append(f"{frame.px(x):.1f},{frame.py(y):.1f}")  # type: ignore[arg-type]
            continue
        if len(run) > 1:
            parts.append(f'<polyline points="{" ".join(run)}" fill="none" stroke="{colour}"{style}/>')
        run = []
    return parts


def _series_parts(frame: Frame, s: Series) -> list[str]:
    """Lines for `s`, dots when there are few points, and a moving mean over long series."""
    valid = [(x, y) for x, y in zip(s.xs, s.ys) if _ok(y) and (not frame.log_y or y > 0)]
    half = 0 if s.markers_only else smoothing_half_window(len(valid))
    if s.markers_only:
        style = ' stroke-dasharray="4 3" stroke-width="1.2"'
    else:
        style = ' stroke-width="1" stroke-opacity="0.3"' if half else ' stroke-width="2"'
    parts = _polylines(frame, s.xs, s.ys, s.colour, style)
    if half:
        parts += _polylines(frame, s.xs, moving_mean(s.ys, half), s.colour, ' stroke-width="2"')
    if s.markers_only or len(valid) <= DOTS_MAX_POINTS:
        r = 4 if s.markers_only else 2.5
        for x, y in valid:
            tip = f"{s.name} @ {fmt_num(x)}: {y:.4g}"
            parts.append(
                f'<circle cx="{frame.px(x):.1f}" cy="{frame.py(y):.1f}" r="{r}" fill="{s.colour}" stroke="#fff" '
                f'stroke-width="1"><title>{escape(tip)}</title></circle>'
            )
    return parts


def line_plot(
    title: str,
    subtitle: str,
    series: list[Series],
    *,
    y_range: tuple[float, float] | None = None,
    log_y: bool | str = False,
    x_label: str = "step",
) -> str:
    """Line chart of `series` (empty ones skipped). `y_range` fixes the y axis; `log_y="auto"` picks log
    when every value is positive and they span two decades or more."""
    series = [s for s in series if s.finite()]
    if not series:
        return empty_plot(title, subtitle)
    for i, s in enumerate(series):
        s.colour = s.colour or PALETTE[i % len(PALETTE)]
    points = [p for s in series for p in s.finite()]
    xs, ys = [x for x, _ in points], [y for _, y in points]
    legend, legend_bottom = _legend([(s.name, s.colour, "dot" if s.markers_only else "line") for s in series], 50)
    use_log = _use_log(ys, log_y) and y_range is None
    x_lo, x_hi, x_ticks = _x_domain(min(xs), max(xs))
    if use_log:
        y_lo, y_hi, y_ticks = log_ticks(min(ys), max(ys))
    elif y_range is not None:
        y_lo, y_hi, y_ticks = linear_ticks(min(y_range[0], *ys), max(y_range[1], *ys))
    else:
        y_lo, y_hi, y_ticks = linear_ticks(min(ys), max(ys))
    frame = Frame(x_lo, x_hi, y_lo, y_hi, legend_bottom + 6, use_log, x_ticks=x_ticks, y_ticks=y_ticks)
    half = max((smoothing_half_window(len(s.finite())) for s in series if not s.markers_only), default=0)
    notes = (" (log scale)" if use_log else "") + (f"; bold: mean of {2 * half + 1} steps" if half else "")
    parts = _header(title, subtitle + notes) + legend + _axes(frame, x_label)
    for s in series:
        parts += _series_parts(frame, s)
    return _svg(title, parts)


def _x_domain(lo: float, hi: float) -> tuple[float, float, list[float]]:
    """The data's x range (padded when it is one point) and integer-spaced ticks inside it."""
    if hi <= lo:
        lo, hi = lo - 1, hi + 1
    _, _, ticks = linear_ticks(lo, hi, 6, integer=True)
    return lo, hi, [t for t in ticks if lo - 1e-9 <= t <= hi + 1e-9]


def stacked_bars(title: str, subtitle: str, xs: list[float], layers: list[tuple[str, list[float | None]]]) -> str:
    """Stacked bars at each x: one layer per (name, values aligned with xs); None counts as 0."""
    layers = [(name, vals) for name, vals in layers if any(_ok(v) and v > 0 for v in vals)]
    if not xs or not layers:
        return empty_plot(title, subtitle)
    colours = [PALETTE[i % len(PALETTE)] for i in range(len(layers))]
    legend, legend_bottom = _legend([(name, c, "box") for (name, _), c in zip(layers, colours)], 50)
    totals = [sum(v for _, vals in layers if _ok(v := vals[i]) and v > 0) for i in range(len(xs))]
    y_lo, y_hi, y_ticks = linear_ticks(0.0, max(totals))
    x_lo, x_hi, x_ticks = _x_domain(min(xs) - 0.5, max(xs) + 0.5)
    frame = Frame(x_lo, x_hi, y_lo, y_hi, legend_bottom + 6, x_ticks=x_ticks, y_ticks=y_ticks)
    bar_w = max(1.0, frame.plot_w / (x_hi - x_lo) * 0.8)
    parts = _header(title, subtitle) + legend + _axes(frame, "step")
    for i, x in enumerate(xs):
        base = 0.0
        for (name, vals), colour in zip(layers, colours):
            v = vals[i]
            if not (_ok(v) and v > 0):
                continue
            top_y, bottom_y = frame.py(base + v), frame.py(base)
            tip = f"step {fmt_num(x)} {name}: {v:.3g}"
            parts.append(
                f'<rect x="{frame.px(x) - bar_w / 2:.1f}" y="{top_y:.1f}" width="{bar_w:.1f}" '
                f'height="{bottom_y - top_y:.1f}" fill="{colour}"><title>{escape(tip)}</title></rect>'
            )
            base += v
    return _svg(title, parts)
