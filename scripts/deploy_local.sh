#!/usr/bin/env bash
# Run scripts/deploy_local.py with the project's virtualenv (override with PYTHON=...).
here="$(cd "$(dirname "$0")/.." && pwd)"
exec "${PYTHON:-$here/.venv/bin/python}" "$here/scripts/deploy_local.py" "$@"
