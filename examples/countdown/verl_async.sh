#!/usr/bin/env bash
# Countdown on the verl backend, async mode: warm start (built once, cached), RL, report, curves.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-.venv/bin/python}" -m examples.countdown.train examples/countdown/verl_async.yaml "$@"
