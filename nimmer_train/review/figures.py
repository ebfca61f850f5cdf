"""The few plots the notebooks share: an annotated heatmap and curves of a wide table."""

from __future__ import annotations

from typing import Any

import pandas as pd


def heatmap(frame: pd.DataFrame, title: str, label: str, ax: Any = None, fmt: str = "{:.3f}") -> Any:
    """``frame`` as an annotated heatmap (rows down, columns across); returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(1.8 + 1.1 * frame.shape[1], 1.4 + 0.6 * frame.shape[0]))
    image = ax.imshow(frame.to_numpy(dtype=float), cmap="viridis_r", aspect="auto")
    ax.set_xticks(range(frame.shape[1]), [str(c) for c in frame.columns], rotation=30, ha="right")
    ax.set_yticks(range(frame.shape[0]), [str(i) for i in frame.index])
    for i in range(frame.shape[0]):
        for j in range(frame.shape[1]):
            value = frame.iat[i, j]
            if pd.notna(value):
                ax.text(j, i, fmt.format(value), ha="center", va="center", color="white", fontsize=8)
    ax.figure.colorbar(image, ax=ax, label=label)
    ax.set_title(title, fontsize=10)
    return ax


def curves(frame: pd.DataFrame, title: str, ax: Any = None, columns: list[str] | None = None) -> Any:
    """Each column of a wide table (index: step) as a line, gaps skipped; returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    for column in columns or list(frame.columns):
        if column in frame:
            series = frame[column].dropna()
            ax.plot(series.index, series.to_numpy(), marker="." if len(series) < 30 else None, label=column)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(frame.index.name or "step")
    ax.legend(fontsize=8)
    return ax
