"""Figures of the validation protocol and of the capacity benchmark (``--plot PATH``).

matplotlib is an optional extra (``pip install -e ".[plot]"``): it is imported only inside
the functions here, which raise ``ValueError`` with a one-line message when it is missing
(:func:`require_matplotlib`). Figures are drawn from plain data — a validation report (its
``"series"``, :class:`~unimem.validate.series.StepSeries` as dicts) or the capacity
benchmark's JSON payload — so a saved JSON can be drawn again.

- :func:`memory_figure`: static pools and the unified arena side by side, bytes in use per
  kind per engine step as stacked areas (FULL, SWA, STATE; the drafter's lanes hatched on
  top of the kind that hosts them), the fixed walls (static: each pool's size, its band;
  unified: the arena), compactions and retractions marked on the time axis, running
  requests on a second axis.
- :func:`capacity_figure`: requests resident at once in one byte budget per workload mix,
  SGLang's default static split vs the best static split vs unified, as grouped bars.
"""

from __future__ import annotations

import os
import platform
from typing import Any

__all__ = [
    "MISSING_MATPLOTLIB",
    "capacity_figure",
    "machine_name",
    "memory_figure",
    "require_matplotlib",
]

MISSING_MATPLOTLIB = (
    "--plot needs matplotlib: pip install 'unimem[plot]' (or pip install matplotlib)"
)
MIB = 1 << 20
KINDS = ("full", "swa", "state")
COLORS = {"full": "#1f77b4", "swa": "#ff7f0e", "state": "#2ca02c"}
LABELS = {"full": "FULL pages", "swa": "SWA pages", "state": "STATE slots"}
FORMATS = (".png", ".svg", ".pdf")
DRAFT = "draft lanes (hatched)"
WALLS = "capacity: static pool walls / unified arena"
RUNNING = "running requests (right axis)"
WALL_STYLE = {"color": "#555555", "lw": 2.0}
TEXT_BOX = {"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1.0}


def require_matplotlib() -> None:
    """``ValueError`` (:data:`MISSING_MATPLOTLIB`) unless matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(MISSING_MATPLOTLIB) from None


def check_plot_path(path: str) -> None:
    """``ValueError`` naming ``--plot`` unless ``path`` ends in a format we write
    (:data:`FORMATS`)."""
    if os.path.splitext(path)[1].lower() not in FORMATS:
        raise ValueError(f"--plot {path}: the file name must end in {', '.join(FORMATS)}")


def _figure(width: float, height: float):
    require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=130, layout="constrained")


def machine_name(gpu: str | None = None) -> str:
    """The GPU's name if given, else ``CPU <model name>`` from ``/proc/cpuinfo`` and the core
    count."""
    if gpu:
        return gpu
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU {model} ({os.cpu_count()} cores)"


def _held(values: list) -> list:
    """``values`` with the last one repeated: the right edge of a post-step curve."""
    return [*values, values[-1]] if values else [0]


def _model_name(cfg: dict) -> str:
    """The checkpoint directory's name, or the preset's name, layers and dtype."""
    if cfg.get("model_path"):
        return os.path.basename(os.path.normpath(cfg["model_path"]))
    from unimem.models.presets import preset

    c = preset(cfg["preset"])
    counts = {k: c.layer_pattern.count(k) for k in ("full", "swa", "gdn")}
    layers = ", ".join(f"{n} {k.upper()}" for k, n in counts.items() if n)
    dtype = str(c.dtype).removeprefix("torch.")
    return f"synthetic '{cfg['preset']}' preset ({layers} layers, {dtype})"


def memory_figure(report: dict, path: str, title: str | None = None) -> None:
    """Draw ``report``'s static and unified series (:mod:`unimem.validate.series`) into
    ``path``. ``title``: the first title line (default: what was run, on which model)."""
    fig = _figure(13.0, 6.2)
    cfg, series = report["config"], report["series"]
    axes = fig.subplots(1, 2, sharey=True)
    top = max(sum(series[m]["capacity"].values()) for m in ("static", "unified"))
    run_max = max(max(series[m]["running"], default=0) for m in ("static", "unified"))
    handles: dict[str, Any] = {}
    for ax, mode in zip(axes, ("static", "unified"), strict=True):
        s = series[mode]
        # step i (1-based) spans [i - 1, i]: edges 0..n, each value held until the next edge
        steps = list(range(len(s["running"]) + 1))
        if mode == "static":
            _static_panel(ax, s, steps, handles)
        else:
            _unified_panel(ax, s, steps, handles)
        _marks(ax, s, top, handles)
        run_ax = ax.twinx()
        (line,) = run_ax.step(
            steps, _held(s["running"]), where="post", color="black", lw=1.2, ls=(0, (4, 1.5))
        )
        handles[RUNNING] = line
        run_ax.set_ylim(0, max(run_max, 1) * 1.25)
        run_ax.set_ylabel("running requests")
        run_ax.yaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("engine step")
        ax.set_xlim(0, max(len(steps) - 1, 1))
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylim(0, top / MIB * 1.12)
        ax.grid(True, alpha=0.3)
        ax.set_title(_panel_title(mode, report[mode], s), fontsize=10)
    axes[0].set_ylabel("memory in use (MiB)")
    fig.suptitle(
        (
            title
            or f"unimem {_command(report)}: static pools vs one unified arena, {_model_name(cfg)}"
        )
        + f"\n{_sizes(cfg, report)} | {machine_name(report.get('gpu'))}",
        fontsize=11,
    )
    order = [*(LABELS[k] for k in KINDS), DRAFT, WALLS, RUNNING, "compaction", "retraction"]
    names = [n for n in order if n in handles]
    fig.legend(
        [handles[n] for n in names],
        names,
        loc="outside lower center",
        ncol=min(len(handles), 5),
        fontsize=9,
        frameon=False,
    )
    fig.savefig(path)


def _command(report: dict) -> str:
    return "bench" if "throughput_ratio" in report else "validate"


def _sizes(cfg: dict, report: dict) -> str:
    spec = f", DSPARK gamma {cfg['gamma']}" if cfg["spec"] != "none" else ""
    cache = ", prefix cache" if cfg.get("prefix_cache") else ""
    return (
        f"{report['requests']} requests x {cfg['input_len']} -> {cfg['output_len']} tokens, "
        f"at most {cfg['max_running']} running, page {cfg['page_size']}{spec}{cache}; "
        f"static {report['static']['capacity_bytes'] / MIB:.2f} MiB, "
        f"arena {report['unified']['capacity_bytes'] / MIB:.2f} MiB"
    )


def _panel_title(mode: str, summary: dict, s: dict) -> str:
    cap = sum(s["capacity"].values()) / MIB
    peak = summary["peak_bytes"] / MIB
    what = "static pools" if mode == "static" else "unified arena"
    out = f"{what}: {cap:.2f} MiB, peak in use {peak:.2f} MiB"
    out += f"\n{summary['steps']} steps, {summary['throughput_tok_s']:.0f} tok/s"
    if mode == "unified":
        out += f", {_count(summary['compactions'], 'compaction')}, "
        out += _count(summary["retractions"], "retraction")
    return out


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _draft_handle():
    """The legend's entry for the drafter's lanes: hatching on any kind's colour."""
    from matplotlib.patches import Patch

    return Patch(facecolor="white", edgecolor="#555555", hatch="//")


def _kind_mib(s: dict, kind: str, draft: bool) -> list[float]:
    d = s["draft_unit_bytes"][kind]
    per = d if draft else s["unit_bytes"][kind] - d
    return _held([n * per / MIB for n in s["units"][kind]])


def _static_panel(ax, s: dict, steps: list[int], handles: dict) -> None:
    """Each pool is a fixed band (its wall a line); its units in use fill it from the band's
    bottom, what is left above them is stranded for the other kinds."""
    base = 0.0
    for kind in (k for k in KINDS if k in s["units"]):
        target = _kind_mib(s, kind, False)
        draft = _kind_mib(s, kind, True)
        lo = [base] * len(steps)
        mid = [base + t for t in target]
        hi = [m + d for m, d in zip(mid, draft, strict=True)]
        h = ax.fill_between(steps, lo, mid, step="post", color=COLORS[kind], lw=0)
        handles.setdefault(LABELS[kind], h)
        if any(draft):
            ax.fill_between(
                steps, mid, hi, step="post", color=COLORS[kind], alpha=0.45, hatch="//", lw=0
            )
            handles.setdefault(DRAFT, _draft_handle())
        wall = base + s["capacity"][kind] / MIB
        h = ax.axhline(wall, **WALL_STYLE)
        handles.setdefault(WALLS, h)
        ax.text(
            0.99,
            wall,
            f"{kind.upper()} pool {s['capacity'][kind] / MIB:.2f} MiB",
            transform=ax.get_yaxis_transform(),
            ha="right",
            va="top",
            fontsize=8,
            bbox=TEXT_BOX,
        )
        base = wall


def _unified_panel(ax, s: dict, steps: list[int], handles: dict) -> None:
    """The kinds stacked from the arena's bottom (the drafter's lanes hatched on top of the
    kind hosting them), under the arena's size."""
    bottom = [0.0] * len(steps)
    for kind in (k for k in KINDS if k in s["units"]):
        for draft in (False, True):
            part = _kind_mib(s, kind, draft)
            if draft and not any(part):
                continue
            top = [b + p for b, p in zip(bottom, part, strict=True)]
            style = {"alpha": 0.45, "hatch": "//"} if draft else {}
            h = ax.fill_between(steps, bottom, top, step="post", color=COLORS[kind], lw=0, **style)
            if draft:
                handles.setdefault(DRAFT, _draft_handle())
            else:
                handles.setdefault(LABELS[kind], h)
            bottom = top
    cap = s["capacity"]["arena"] / MIB
    h = ax.axhline(cap, **WALL_STYLE)
    handles.setdefault(WALLS, h)
    ax.text(
        0.99,
        cap,
        f"arena {cap:.2f} MiB",
        transform=ax.get_yaxis_transform(),
        ha="right",
        va="top",
        fontsize=8,
        bbox=TEXT_BOX,
    )


def _marks(ax, s: dict, top: float, handles: dict) -> None:
    """Compactions (purple triangles) and retractions (red crosses) above the walls, at the
    steps they happened (several in one step share a mark)."""
    y = top / MIB * 1.06
    for key, label, style in (
        ("compaction_steps", "compaction", {"marker": "v", "color": "#7b2cbf"}),
        ("retraction_steps", "retraction", {"marker": "x", "color": "#d62828"}),
    ):
        at = [i - 0.5 for i in sorted(set(s[key]))]
        if at:
            (h,) = ax.plot(at, [y] * len(at), ls="none", ms=6, **style)
            ax.vlines(at, 0, y, color=style["color"], lw=0.5, alpha=0.35)
            handles.setdefault(label, h)


def capacity_figure(payload: dict, path: str) -> None:
    """Draw the capacity benchmark's results (its JSON payload) into ``path``: per mix, requests
    resident at once for SGLang's default static split, the best static split and the
    unified arena (bars, counts on top), the byte-perfect ideal arena as a dashed tick."""
    fig = _figure(9.0, 5.4)
    ax = fig.subplots()
    results = payload["results"]
    bars = (
        ("static_default", "static, SGLang's default split", "#9e9e9e"),
        ("static_best", "static, best split for the mix", "#1f77b4"),
        ("unified", "unified arena", "#2ca02c"),
    )
    width = 0.26
    xs = list(range(len(results)))
    for j, (key, label, color) in enumerate(bars):
        pos = [x + (j - 1) * width for x in xs]
        vals = [r[key] for r in results]
        rects = ax.bar(pos, vals, width, label=label, color=color)
        ax.bar_label(rects, fontsize=8, padding=2)
    for x, r in zip(xs, results, strict=True):
        ax.hlines(
            r["ideal_arena"],
            x - 1.5 * width,
            x + 1.5 * width,
            colors="black",
            linestyles="dashed",
            lw=1.0,
            label="ideal arena (byte-perfect, computed)" if x == 0 else None,
        )
    ax.set_xticks(xs, [f"{r['name']}\n{r['description']}" for r in results], fontsize=8)
    ax.set_xlabel("workload mix (request length = prompt + output tokens)")
    ax.set_ylabel("requests resident at once")
    ax.set_ylim(0, max(max(r[k] for k, *_ in bars) for r in results) * 1.15 + 1)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    budget = payload["budget_bytes"] / (1 << 30)
    fig.suptitle(
        f"Requests admitted in one {budget:g} GiB budget: static splits vs the unified arena\n"
        f"{payload['preset']} preset's memory spec, page {payload['page_size']} | "
        f"{payload['device']}, {payload['date']}",
        fontsize=10,
    )
    fig.savefig(path)
