"""`unified plot runs/<name>`: the run's curves as one PNG (reward, eval accuracy, entropy, KL).

Reads `metrics.jsonl`; matplotlib is imported only here, with the non-interactive Agg backend.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from unified.errors import UsageError

__all__ = ["panels", "plot_run"]

# Each panel draws the first of its metrics the run logged: the KL panel shows the KL to the
# reference when the run has one (`trainer.kl_coef > 0`), else the sampler-trainer mismatch.
_PANELS: tuple[tuple[tuple[str, str], ...], ...] = (
    (("reward/mean", "training reward (mean)"),),
    (("eval/accuracy", "eval accuracy (greedy)"),),
    (("train/entropy", "policy entropy (nats/token)"),),
    (
        ("train/kl_reference", "KL to the reference (nats/token)"),
        ("train/kl_sample_train", "KL(sampler || trainer)"),
    ),
)


def panels(rows: list[dict[str, float]]) -> list[tuple[str, str]]:
    """The metric and title of each of the four panels, for a run that logged `rows`."""
    logged = {key for row in rows for key, value in row.items() if value is not None}
    return [next((c for c in choices if c[0] in logged), choices[-1]) for choices in _PANELS]


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Write the curves of `run_dir` to `output` (default `<run_dir>/curves.png`)."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UsageError(f"{str(run_dir)!r} has no metrics.jsonl; give a run directory runs/<name>")
    text = path.read_text()
    lines = text.splitlines()
    if text and not text.endswith("\n"):
        lines = lines[:-1]  # a line still being written (a live run): not a step yet
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise UsageError(f"{str(path)!r} line {number} is not JSON ({e.msg})") from None
    if not rows:
        raise UsageError(f"{str(path)!r} is empty: the run logged no step yet")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), constrained_layout=True)
    for ax, (key, title) in zip(axes.flat, panels(rows), strict=True):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker="o" if key.startswith("eval/") else None, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    fig.suptitle(run_dir.name)
    target = Path(output) if output is not None else run_dir / "curves.png"
    if target.is_dir():
        plt.close(fig)
        raise UsageError(f"--output {str(target)!r} is a folder; give a .png path in it")
    if not target.parent.is_dir():
        plt.close(fig)
        raise UsageError(f"--output {str(target)!r}: its folder does not exist; create it first")
    staged = target.with_name(f".{target.name}.tmp.png")
    try:
        fig.savefig(staged, dpi=110)
        os.replace(staged, target)
    finally:
        plt.close(fig)
        staged.unlink(missing_ok=True)
    return target
