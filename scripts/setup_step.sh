#!/usr/bin/env bash
# One stage of `make setup` (system packages, the venv, each pip install, a
# model build), shown as one progress line:
#
#   setup: pip install -e .[cpu,...] ...................... ok   212 s
#
# The command's whole output (pip's hundreds of lines) is appended to
# $SETUP_LOG (default .cache/setup.log) under a "=== LABEL: COMMAND" header,
# so a fresh clone's `make demo` stays a screenful. On failure the log's last
# $SETUP_TAIL_LINES lines are shown, since the cause is there, and the
# command's exit status is returned. VERBOSE=1 (not empty, not 0) shows the
# output as it comes, and still logs it.
#
# Usage: setup_step.sh LABEL COMMAND [ARG...]   (a compound command: sh -c '...')
set -uo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 LABEL COMMAND [ARG...]" >&2
  exit 2
fi
label=$1
shift
log=${SETUP_LOG:-.cache/setup.log}
tail_lines=${SETUP_TAIL_LINES:-40}
verbose=${VERBOSE:-}
[ "$verbose" = 0 ] && verbose=

mkdir -p "$(dirname "$log")"
printf '=== %s: %s\n' "$label" "$*" >>"$log"
start=$SECONDS
if [ -n "$verbose" ]; then
  echo "setup: $label"
  "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
else
  # Dots to column 60, so the stages' verdicts line up; long labels just get two.
  dots=$(( 52 - ${#label} ))
  [ $dots -lt 2 ] && dots=2
  printf 'setup: %s %s ' "$label" "$(printf '%*s' "$dots" '' | tr ' ' .)"
  "$@" >>"$log" 2>&1 </dev/null
  rc=$?
fi
elapsed=$(( SECONDS - start ))
if [ $rc -eq 0 ]; then
  if [ -n "$verbose" ]; then echo "setup: $label: ok (${elapsed} s)"; else printf 'ok %5d s\n' "$elapsed"; fi
  exit 0
fi
if [ -n "$verbose" ]; then
  echo "setup: $label: FAILED (exit status $rc)" >&2
else
  printf 'FAILED (exit status %d)\n' "$rc"
  echo "last $tail_lines lines of $log (all of it: VERBOSE=1 make setup, or the file):" >&2
  tail -n "$tail_lines" "$log" | sed 's/^/  | /' >&2
fi
exit $rc
