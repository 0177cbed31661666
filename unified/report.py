"""`unified report runs/<name>`: one self-contained `report.html` of a run (`--serve`: the same
page over HTTP, read afresh at each load, for a run still going).

It reads what the run wrote: `config.yaml`, `metrics.jsonl`, `ledger.jsonl` and the rollout
records (`unified.records`), and writes one HTML file that needs no network and opens from the
file system: the curves, the timeline of steps, syncs and episodes, the trained and generated
length distributions, the ledger's outcomes, and an episode browser with every recorded
episode's tokens coloured by the policy version that sampled them. The charts are uPlot
(MIT, vendored in `unified/report_assets/`: 50 KB, draws thousands of points on a canvas in
milliseconds); the timeline and the token view are the page's own code.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from unified.checkpoint import RunDirectory
from unified.errors import UsageError
from unified.records import (
    EpisodeRecord,
    EvalRecord,
    Record,
    RecordError,
    RunRecord,
    SaveRecord,
    StepRecord,
    read_records,
)

__all__ = ["render_report", "report_data", "serve_report", "write_report"]

_HISTOGRAM_BINS = 30


def write_report(run_dir: str | Path, output: str | Path | None = None) -> tuple[Path, list[str]]:
    """Write the report of `run_dir` to `output` (default `<run_dir>/report.html`); return its
    path and the warnings met on the way (a torn last record, a run without records)."""
    run_dir = Path(run_dir)
    html, warnings = render_report(run_dir)
    path = Path(output) if output is not None else run_dir / "report.html"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(html, encoding="utf-8")
    os.replace(tmp, path)
    return path, warnings


def serve_report(run_dir: str | Path, port: int, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """An HTTP server (not yet serving: call `serve_forever`) whose `/` is the report of
    `run_dir` as the run is now, read afresh at each load; a damaged record answers 500 with
    its one-line error. Bound to `host`, the loopback address unless told otherwise."""
    directory = Path(run_dir)

    class Report(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path not in ("/", "/report.html"):
                self._reply(404, "text/plain", b"the report is at /")
                return
            try:
                html, _ = render_report(directory)
            except Exception as e:  # a damaged record, or a file the live run just rotated away
                said = str(e) if isinstance(e, UsageError) else f"{type(e).__name__}: {e}"
                self._reply(500, "text/plain; charset=utf-8", said.encode())
                return
            self._reply(200, "text/html; charset=utf-8", html.encode())

        def _reply(self, status: int, kind: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per load would drown the console

    return ThreadingHTTPServer((host, port), Report)


def render_report(run_dir: Path) -> tuple[str, list[str]]:
    """The report page of `run_dir`, and the warnings met reading it."""
    data, warnings = report_data(run_dir)
    assets = resources.files("unified") / "report_assets"
    html = (assets / "report.html").read_text(encoding="utf-8")
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False)
    # Inside <script>, "</" would end the element early: JSON allows "<\/" for it.
    payload = payload.replace("</", "<\\/")
    for marker, text in (
        ("/*__UPLOT_CSS__*/", (assets / "uPlot.min.css").read_text(encoding="utf-8")),
        ("/*__UPLOT_JS__*/", (assets / "uPlot.iife.min.js").read_text(encoding="utf-8")),
        ("__TITLE__", _escape(f"unified report: {run_dir.name}")),
        ("/*__DATA__*/", payload),
    ):
        html = html.replace(marker, text, 1)
    return html, warnings


def report_data(run_dir: Path) -> tuple[dict[str, Any], list[str]]:
    """Everything the page draws, as plain JSON-ready data; and the warnings met."""
    if not (run_dir / "metrics.jsonl").is_file() and not (run_dir / "config.yaml").is_file():
        raise UsageError(
            f"{str(run_dir)!r} is not a run directory (no config.yaml, no metrics.jsonl); give "
            "runs/<name>"
        )
    try:
        records, warnings = read_records(run_dir)
    except RecordError as e:
        raise UsageError(f"cannot report: {e}") from None
    if not records:
        warnings.append(
            f"{run_dir}: no rollout records (a run from before them, or logging.record_every=0 "
            "with logging.record_eval=false): no episodes or timeline to show"
        )
    config_text = _read_text(run_dir / "config.yaml")
    config = yaml.safe_load(config_text) or {} if config_text else {}
    ledger = _ledger(run_dir)
    episodes = [r for r in records if isinstance(r, EpisodeRecord)]
    return {
        "name": run_dir.name,
        "config": config_text,
        "mode": config.get("mode", ""),
        "backend": config.get("backend", ""),
        "metrics": _metrics(run_dir / "metrics.jsonl"),
        "ledger": ledger,
        "episodes": [_episode(r) for r in episodes],
        "timeline": _timeline(records),
        "lengths": _lengths(episodes),
        "warnings": warnings,
    }, warnings


def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8") if path.is_file() else ""


def _metrics(path: Path) -> dict[str, Any]:
    """Columns of `metrics.jsonl`: `step` and one list per metric (null where a line lacks it)."""
    rows: list[dict[str, Any]] = []
    if path.is_file():
        lines = path.read_text(encoding="utf-8").split("\n")
        for number, line in enumerate(lines[:-1], start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(
                    f"cannot report: {path}:{number}: not JSON ({e.msg}); the file is damaged"
                ) from None
            if not isinstance(row, dict) or "step" not in row:
                raise UsageError(f"cannot report: {path}:{number}: a metrics line without a step")
            rows.append(row)
    keys = sorted({k for row in rows for k in row if k != "step"})
    return {
        "step": [row["step"] for row in rows],
        "series": {key: [_number(row.get(key)) for row in rows] for key in keys},
    }


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(f"{value:.6g}")


def _ledger(run_dir: Path) -> dict[str, Any]:
    """Outcomes per step, totals, and the most common reasons of untrained groups."""
    try:
        entries = RunDirectory(run_dir).read_ledger()
    except ValueError as e:
        raise UsageError(f"cannot report: {run_dir / 'ledger.jsonl'}: {e}") from None
    per_step: dict[str, Counter[int]] = defaultdict(Counter)
    reasons: Counter[str] = Counter()
    for entry in entries:
        per_step[entry.outcome][entry.step] += 1
        if entry.outcome != "trained":
            reasons[f"{entry.outcome}: {_reason_kind(entry.reason)}"] += 1
    steps = sorted({e.step for e in entries})
    return {
        "step": steps,
        "outcomes": {o: [per_step[o][s] for s in steps] for o in sorted(per_step)},
        "totals": {o: sum(c.values()) for o, c in sorted(per_step.items())},
        "reasons": reasons.most_common(12),
    }


def _reason_kind(reason: str) -> str:
    """A reason with its numbers blanked, so that alike reasons count together."""
    return "".join("#" if c.isdigit() else c for c in reason).replace("##", "#")[:120]


def _episode(r: EpisodeRecord) -> dict[str, Any]:
    return {
        "step": r.step,
        "group": r.group_id,
        "task": r.task,
        "i": r.index,
        "outcome": r.outcome,
        "trained": r.trained,
        "status": r.status,
        "error": r.error,
        "reward": r.reward,
        "advantage": r.advantage,
        "correct": r.correct,
        "version": r.policy_version,
        "trainer_version": r.trainer_version,
        "tokens": sum(len(t.ids) for t in r.turns),
        "turns": [
            {
                "trajectory": t.trajectory,
                "prompt": t.prompt,
                "pieces": t.pieces,
                "ids": t.ids,
                "logprobs": t.logprobs,
                "versions": t.versions,
                "finish": t.finish,
                "reward": t.reward,
                "info": t.info,
            }
            for t in r.turns
        ],
    }


def _timeline(records: list[Record]) -> dict[str, Any]:
    """What the Gantt draws: the steps' spans, the syncs, evaluations, saves, run starts, and
    the recorded training episodes' dispatch, start, calls and end."""
    steps = [
        {"step": r.step, "synced_to": r.synced_to, "spans": r.spans}
        for r in records
        if isinstance(r, StepRecord)
    ]
    episodes = [
        {
            "step": r.step,
            "group": r.group_id,
            "i": r.index,
            "outcome": r.outcome,
            "trained": r.trained,
            "dispatched": r.timing.dispatched,
            "started": r.timing.started,
            "ended": r.timing.ended,
            "calls": r.timing.calls,
        }
        for r in records
        if isinstance(r, EpisodeRecord) and r.timing is not None
    ]
    return {
        "steps": steps,
        "episodes": episodes,
        "evals": [
            {"step": r.step, "start": r.start, "end": r.end, "accuracy": r.accuracy}
            for r in records
            if isinstance(r, EvalRecord)
        ],
        "saves": [
            {"step": r.step, "start": r.start, "end": r.end}
            for r in records
            if isinstance(r, SaveRecord)
        ],
        "runs": [
            {"step": r.step, "started": r.started} for r in records if isinstance(r, RunRecord)
        ],
    }


def _lengths(episodes: list[EpisodeRecord]) -> dict[str, Any]:
    """Histograms of completion tokens per episode: every recorded training episode that
    finished (generated) and those that trained."""
    generated = [
        sum(len(t.ids) for t in r.turns)
        for r in episodes
        if r.outcome != "eval" and r.status == "ok"
    ]
    trained = [sum(len(t.ids) for t in r.turns) for r in episodes if r.trained]
    if not generated:
        return {"edges": [], "generated": [], "trained": [], "means": [None, None]}
    top = max(generated)
    width = max(1, math.ceil((top + 1) / _HISTOGRAM_BINS))
    bins = math.ceil((top + 1) / width)

    def histogram(lengths: list[int]) -> list[int]:
        counts = [0] * bins
        for n in lengths:
            counts[n // width] += 1
        return counts

    return {
        "edges": [i * width for i in range(bins)],
        "generated": histogram(generated),
        "trained": histogram(trained),
        "means": [
            sum(generated) / len(generated),
            sum(trained) / len(trained) if trained else None,
        ],
    }


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
