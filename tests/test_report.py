"""`unified report`: one self-contained HTML file of a real run, opened in headless Chromium as a
person would (charts drawn, an episode found by its step and opened, no console error), the
command's answers to bad input, and what the records say about the run's timeline."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.browser import Chromium, chromium_path
from bench.crashing import countdown_config
from unified import UnifiedTrainer
from unified.cli import main
from unified.records import EpisodeRecord, StepRecord, read_records, record_files
from unified.report import serve_report, write_report

STEPS = 6


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real async countdown run on the local backend: every group recorded, evaluations."""
    root = tmp_path_factory.mktemp("report")
    config = countdown_config(root, "report", "async", total_steps=STEPS, eval_every=3)
    config["data"]["eval"] = {"generator": "examples.countdown.tasks:make_tasks", "n": 6}
    config["trainer"]["eval_before_train"] = True
    config["resume"] = False
    result = UnifiedTrainer(config).fit()
    return result.run_dir


def test_the_records_hold_the_timeline_of_every_step_and_episode(run_dir: Path) -> None:
    records, warnings = read_records(run_dir)
    assert warnings == []
    steps = [r for r in records if isinstance(r, StepRecord)]
    assert [s.step for s in steps] == list(range(1, STEPS + 1))
    for s in steps:
        kinds = [kind for kind, _, _ in s.spans]
        assert "wait" in kinds and "forward" in kinds and "optim" in kinds
        assert ("sync" in kinds) == (s.synced_to is not None), "sync_every=1: each step syncs"
        assert all(a <= b for _, a, b in s.spans)
    train = [r for r in records if isinstance(r, EpisodeRecord) and r.outcome != "eval"]
    assert train and all(r.timing is not None for r in train)
    for r in train:
        t = r.timing
        assert t is not None and t.dispatched <= t.started <= t.ended
        assert t.calls and all(t.started <= c[0] and c[-1] <= t.ended for c in t.calls)
        assert all(list(c) == sorted(c) for c in t.calls), "request <= tokens <= reply"
        # The built-in sampler reports each call's first and last token.
        assert all(len(c) == 4 for c in t.calls), t.calls
    evals = [r for r in records if isinstance(r, EpisodeRecord) and r.outcome == "eval"]
    assert sorted({r.step for r in evals}) == [0, 3, 6] and len(evals) == 3 * 6


def test_the_report_is_one_file_that_loads_nothing_from_elsewhere(run_dir: Path) -> None:
    path, warnings = write_report(run_dir, run_dir / "copy.html")
    html = path.read_text()
    assert path == run_dir / "copy.html" and warnings == []
    assert "<script src" not in html and "<link" not in html and "@import" not in html
    data = json.loads(html.split('id="report-data">', 1)[1].split("</script>", 1)[0])
    assert data["metrics"]["step"][-1] == STEPS
    assert data["ledger"]["totals"]["trained"] == STEPS * 2
    assert len(data["timeline"]["steps"]) == STEPS


def test_the_command_writes_it_and_answers_bad_input_in_one_line(
    run_dir: Path, tmp_path: Path
) -> None:
    def report(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "unified.cli", "report", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    done = report(str(run_dir))
    assert done.returncode == 0, done.stderr
    assert f"wrote {run_dir / 'report.html'}" in done.stdout

    missing = report(str(tmp_path / "nope"))
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1

    damaged = tmp_path / "damaged"
    shutil.copytree(run_dir, damaged)
    (_, first), *_ = record_files(damaged / "records")
    lines = gzip.decompress(first.read_bytes()).decode().splitlines()
    lines[1] = lines[1][: len(lines[1]) // 2]  # cut in the middle, not at the end
    first.write_bytes(gzip.compress("".join(line + "\n" for line in lines).encode()))
    bad = report(str(damaged))
    message = bad.stderr.strip()
    assert bad.returncode == 2 and len(message.splitlines()) == 1, message
    assert f"{first}:2: not JSON" in message


def test_serve_answers_the_report_as_the_run_is_at_each_load(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import threading
    import urllib.error
    import urllib.request

    live = tmp_path / "live"
    shutil.copytree(run_dir, live)
    server = serve_report(live, 0)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with urllib.request.urlopen(url + "/", timeout=30) as reply:
            html = reply.read().decode()
        data = json.loads(html.split('id="report-data">', 1)[1].split("</script>", 1)[0])
        assert len(data["timeline"]["steps"]) == STEPS

        (_, first), *_ = record_files(live / "records")  # the run changes: the next load sees it
        first.write_bytes(gzip.compress(b'{"type": "nope"}\n'))
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(url + "/", timeout=30)
        assert failed.value.code == 500 and f"{first}:1: " in failed.value.read().decode()
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(url + "/other", timeout=30)
    finally:
        server.shutdown()
        server.server_close()
        serving.join(timeout=30)

    assert main(["report", str(live), "--serve", "70000"]) == 2
    assert main(["report", str(live), "--serve", "0", "--output", "x.html"]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert "a port is 0-65535" in said[0] and "do not go together" in said[1]


CHROMIUM = chromium_path()


@pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium)"
)
def test_the_report_renders_in_headless_chromium(run_dir: Path, tmp_path: Path) -> None:
    assert CHROMIUM is not None
    path, _ = write_report(run_dir)
    records, _ = read_records(run_dir)
    known = next(
        r for r in records if isinstance(r, EpisodeRecord) and r.trained and r.step == STEPS
    )
    text = "".join(known.turns[0].pieces)
    profile = tmp_path / "profile"
    profile.mkdir()
    with Chromium(CHROMIUM, profile) as browser:
        browser.open(path.resolve().as_uri(), ready="document.body.dataset.ready === '1'")
        drawn = browser.evaluate(
            """[...document.querySelectorAll('.chart canvas, #gantt')].map((c) => {
                 const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                 let ink = 0;
                 for (let i = 0; i < d.length; i += 4)
                   if (d[i + 3] && d[i] + d[i + 1] + d[i + 2] < 600) ink++;
                 return ink; })"""
        )
        assert len(drawn) >= 8 and all(ink > 50 for ink in drawn), f"blank charts: {drawn}"
        # As a person would: filter to the episode's step and outcome, open it by its row.
        browser.evaluate(
            f"""(() => {{
                 const set = (id, v) => {{ const el = document.getElementById(id); el.value = v;
                   el.dispatchEvent(new Event('input')); }};
                 set('f-step-min', {known.step}); set('f-step-max', {known.step});
                 set('f-outcome', 'trained'); }})()"""
        )
        row = browser.evaluate(
            f"""[...document.querySelectorAll('#ep-rows tr')].findIndex((tr) =>
                 tr.cells[1].textContent === {json.dumps(known.group_id)}
                 && tr.cells[2].textContent === '{known.index}')"""
        )
        assert row >= 0, "the episode is listed under its step and outcome"
        browser.evaluate(f"document.querySelectorAll('#ep-rows tr')[{row}].click()")
        shown = browser.evaluate("document.getElementById('episode').innerText")
        assert known.group_id in shown and known.turns[0].prompt.strip()[:10] in shown
        tokens = browser.evaluate(
            "[...document.querySelectorAll('#episode .tokens')[0].children]"
            ".map((t) => t.textContent).join('')"
        )
        assert tokens == text, "each sampled token, in order"
        assert browser.errors() == []
        shot = browser.screenshot(tmp_path / "report.png")
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")
