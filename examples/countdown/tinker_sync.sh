#!/usr/bin/env bash
# Countdown on the tinker backend (a local Tinker-compatible server unless TINKER_API_KEY is set), sync mode: warm start (built once, cached), RL, report, curves.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-.venv/bin/python}" -m examples.countdown.train examples/countdown/tinker_sync.yaml "$@"
