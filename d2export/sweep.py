"""Hydra callback for `--multirun`: one summary table when a sweep ends (configs name it in hydra.callbacks)."""
from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback


class SweepSummary(Callback):
    """Collects each job's summary row and prints one table when a sweep ends."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, dict | None]] = []

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        overrides = " ".join(config.hydra.overrides.task) or "(defaults)"
        value = getattr(job_return, "_return_value", None)
        self.rows.append((overrides, value if isinstance(value, dict) else None))

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        print(format_sweep(self.rows))


def format_sweep(rows: list[tuple[str, dict | None]]) -> str:
    lines = [f"{'overrides':<48} {'verified':>8} {'max abs':>10} {'seconds':>8}  model"]
    for overrides, r in rows:
        if r is None:
            lines.append(f"{overrides:<48} {'FAILED':>8}")
        else:
            max_abs = f"{r['max_abs']:.3g}" if r.get("max_abs") is not None else "-"
            lines.append(f"{overrides:<48} {str(r['verified']):>8} {max_abs:>10} {r['seconds']:>8.1f}  {r['model']}")
    return "sweep summary\n" + "\n".join(lines)
