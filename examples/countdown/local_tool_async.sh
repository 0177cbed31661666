#!/usr/bin/env bash
# The tool-using countdown agent, local backend, async mode: warm start (built once, cached), RL, report.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-.venv/bin/python}" -m examples.countdown.train examples/countdown/local_tool_async.yaml "$@"
