"""How big a run's records and report are, and how fast the report opens in headless Chromium.

    python -m bench.report runs/<name> [--repeats 5] [--json runs/bench-report.json]
        [--screenshot docs/images/report.png]

Writes the run's `report.html` (timed), then opens it `--repeats` times in a fresh tab and
takes the time from navigation to the page's ready mark (every chart, the timeline and the
episode table drawn). The baseline, in the same browser: the same page with no run in it (the
page, uPlot and an empty data set), so the ratio is what the run's data costs. With
`--screenshot`, it opens the first trained episode of the last step, as the README shows it.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.browser import Chromium, chromium_path
from unified.records import RECORDS_DIR
from unified.report import write_report

READY = "document.body.dataset.ready === '1'"


def empty_report(path: Path, like: Path) -> Path:
    """`like` with its data replaced by an empty run: the page alone."""
    html = like.read_text(encoding="utf-8")
    head, rest = html.split('id="report-data">', 1)
    _, tail = rest.split("</script>", 1)
    empty = {
        "name": "empty",
        "config": "",
        "mode": "",
        "backend": "",
        "metrics": {"step": [], "series": {}},
        "ledger": {"step": [], "outcomes": {}, "totals": {}, "reasons": []},
        "episodes": [],
        "timeline": {"steps": [], "episodes": [], "evals": [], "saves": [], "runs": []},
        "lengths": {"edges": [], "generated": [], "trained": [], "means": [None, None]},
        "warnings": [],
    }
    path.write_text(f'{head}id="report-data">{json.dumps(empty)}</script>{tail}', "utf-8")
    return path


def open_ms(browser: Chromium, path: Path, repeats: int) -> float:
    """Median milliseconds from navigation to the ready mark, over `repeats` loads."""
    times = []
    for _ in range(repeats):
        browser.open("about:blank", ready="true")
        started = time.monotonic()
        browser.open(path.resolve().as_uri(), ready=READY)
        times.append((time.monotonic() - started) * 1e3)
    return statistics.median(times)


def screenshot(browser: Chromium, path: Path) -> None:
    """The curves' first row, the timeline, and a trained episode of the last step opened."""
    browser.evaluate(
        """(() => {
          const steps = D.timeline.steps, last = steps[steps.length - 1].step;
          const set = (id, v) => { const el = document.getElementById(id); el.value = v;
            el.dispatchEvent(new Event('input')); };
          set('f-kind', 'train'); set('f-outcome', 'trained'); set('f-step-min', last - 3);
          document.querySelector('#ep-rows tr').click();
        })()"""
    )
    top = browser.evaluate("document.getElementById('gantt-wrap').offsetTop - 60")
    # The timeline, then the table's first rows and the episode: the lengths, ledger and the
    # rest of the table are folded away for the picture.
    browser.evaluate(
        """(() => {
          for (const id of ['lengths', 'lengths-note', 'ledger-chart', 'ledger-table'])
            document.getElementById(id).style.display = 'none';
          for (const h of document.querySelectorAll('h2'))
            if (/Lengths|Ledger/.test(h.textContent)) h.style.display = 'none';
          [...document.querySelectorAll('#ep-rows tr')].slice(6).forEach((tr) => tr.remove());
          document.getElementById('pager').style.display = 'none';
        })()"""
    )
    bottom = browser.evaluate(
        "(() => { const e = document.getElementById('episode'); "
        "return e.offsetTop + e.offsetHeight + 10; })()"
    )
    data = browser.send(
        "Page.captureScreenshot",
        format="png",
        captureBeyondViewport=True,
        clip={"x": 0, "y": top, "width": 1280, "height": bottom - top, "scale": 1},
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(data["data"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--screenshot", type=Path, help="a PNG of the page, an episode open")
    args = parser.parse_args()
    executable = chromium_path()
    if executable is None:
        raise SystemExit("no chromium on PATH (Debian: apt-get install chromium)")
    started = time.monotonic()
    path, _ = write_report(args.run_dir)
    write_s = time.monotonic() - started
    records = sum(p.stat().st_size for p in (args.run_dir / RECORDS_DIR).glob("*"))
    with tempfile.TemporaryDirectory() as tmp:
        baseline_page = empty_report(Path(tmp) / "empty.html", path)
        profile = Path(tmp) / "profile"
        profile.mkdir()
        with Chromium(executable, profile) as browser:
            baseline = open_ms(browser, baseline_page, args.repeats)
            run = open_ms(browser, path, args.repeats)
            episodes = browser.evaluate("document.getElementById('ep-count').textContent")
            if args.screenshot:
                screenshot(browser, args.screenshot)
            errors = browser.errors()
    figures = {
        "records_mb": records / 2**20,
        "report_mb": path.stat().st_size / 2**20,
        "write_s": write_s,
        "open_ms": run,
        "open_ms_empty_page": baseline,
        "console_errors": len(errors),
    }
    print(f"{args.run_dir}: {episodes}")
    sizes = f"records {figures['records_mb']:.2f} MB (gzip); report.html"
    print(f"  {sizes} {figures['report_mb']:.1f} MB")
    print(f"  unified report wrote it in {write_s:.2f} s")
    print(
        f"  opens in {run:.0f} ms to the ready mark (median of {args.repeats}; the page with "
        f"no run: {baseline:.0f} ms, {run / baseline:.1f}x); console errors: {len(errors)}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
