#!/usr/bin/env bash
# The project's lint, type and format checks, as CI runs them (seconds, not minutes):
#   bash tools/lint.sh          # check: fails on any finding
#   bash tools/lint.sh --fix    # apply what ruff and clang-format can fix, then check
# The tools are the versions pinned in pyproject.toml's "lint" extra (.ci/run installs exactly those);
# their configuration is in pyproject.toml ([tool.ruff], [tool.mypy]) and .clang-format.
set -euo pipefail
cd "$(dirname "$0")/.."

cpp_files=()
while IFS= read -r f; do cpp_files+=("$f"); done < <(git ls-files 'csrc/*' 'tests/cpp/*' 'tests/cuda_emulator/*' | grep -E '\.(h|cpp|cu|cuh)$')

if [ "${1:-}" = "--fix" ]; then
  ruff check --fix .
  ruff format .
  clang-format -i "${cpp_files[@]}"
fi

status=0
run() {
  local name="$1"
  shift
  if "$@"; then echo "lint: ok $name"; else echo "lint: FAILED $name" >&2; status=1; fi
}
run "ruff check" ruff check --quiet .
run "ruff format" ruff format --check --quiet .
run "mypy (nanscan/, examples/, the doc tools)" mypy --no-error-summary
run "clang-format (${#cpp_files[@]} files)" clang-format --dry-run --Werror "${cpp_files[@]}"
exit $status
