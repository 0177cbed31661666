#!/usr/bin/env bash
# The countdown tool agent on the plain openai client, through the gateway, tinker backend, sync: warm start (built once, cached), RL, report.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-.venv/bin/python}" -m examples.countdown.train examples/countdown/tinker_openai_agent_sync.yaml "$@"
