"""Byte-stable output: each figure laid out once and written atomically per format, without timestamps."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from roundalign.analysis.plots import _grid
from roundalign.analysis.plots._style import style
from roundalign.io import atomic_path

FORMATS = ("png", "pdf", "svg")
# Per-format metadata that drops the creation date (PDF, SVG) and the software string (PNG), so that
# reruns produce identical bytes.
_METADATA = {"png": {"Software": None}, "pdf": {"CreationDate": None}, "svg": {"Date": None}}
# PNG at zlib level 1 (Pillow's default is 6): the figures' flat colours compress to 10% more bytes at about 2/3 of
# the encoding time, which is a tenth of a figure's PNG (results/bench/workflow.txt, make figures)
_SAVE_KWARGS = {"png": {"pil_kwargs": {"compress_level": 1}}, "pdf": {}, "svg": {}}


def save(fig: Figure, out_dir: str | Path, stem: str, formats) -> list[Path]:
    """Write ``<out_dir>/<stem>.<fmt>`` for each format (atomically) and return the paths."""
    # Spines out of the layout: the style draws no tick marks, so a spine reaches half its line width past its
    # axes, yet measuring it makes matplotlib recompute the axis' ticks, four spines a panel and twice per layout
    # (a fifth of the layout time of a 24-panel figure).
    for ax in fig.axes:
        for spine in ax.spines.values():
            spine.set_in_layout(False)
    # Lay out once and freeze: constrained layout is not idempotent (a second pass can move the axes by a fraction
    # of a point), so without this the bytes of a format would depend on which formats were saved before it.
    # Frozen with no layout engine at all (None, not "none"): savefig gives a figure with any engine, even
    # "none"'s placeholder, an extra draw before the real one, so each format costs one draw.
    paths = []
    with style():  # once for the layout and every format (each entry resets every rcParam)
        engine = fig.get_layout_engine()
        if engine is not None:
            engine.execute(fig)  # what Figure.draw runs first, without the disabled draw of every artist after it
        elif _grid.layout_of(fig) is not None:
            _grid.layout_of(fig)(fig)
        fig.set_layout_engine(None)
        for fmt in formats:
            path = Path(out_dir) / f"{stem}.{fmt}"
            with atomic_path(path) as tmp:
                fig.savefig(tmp, format=fmt, metadata=_METADATA[fmt], **_SAVE_KWARGS[fmt])
            paths.append(path)
    return paths


def check_formats(formats) -> tuple[str, ...]:
    formats = tuple(formats)
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise ValueError(f"formats {', '.join(bad) or '(none)'} not supported; choose from {', '.join(FORMATS)}")
    return formats

