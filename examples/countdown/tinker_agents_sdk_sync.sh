#!/usr/bin/env bash
# The countdown tool agent on the OpenAI Agents SDK, through the gateway, tinker backend, sync: warm start (built once, cached), RL, report.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-.venv/bin/python}" -m examples.countdown.train examples/countdown/tinker_agents_sdk_sync.yaml "$@"
