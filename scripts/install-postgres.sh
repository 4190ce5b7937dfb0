#!/usr/bin/env bash
# Install PostgreSQL's server programs from the distribution's packages when `initdb` is missing
# (the tests start their own private cluster with initdb and postgres; they never use the
# system service the package may start). Prints the versioned bin directory it found.
set -euo pipefail
find_bin() {
  if command -v initdb >/dev/null 2>&1; then dirname "$(command -v initdb)"; return 0; fi
  local dir
  dir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -t/ -k4 -n | tail -n 1 || true)
  if [ -n "$dir" ] && [ -x "$dir/initdb" ]; then echo "$dir"; return 0; fi
  return 1
}
if find_bin; then exit 0; fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq postgresql >/dev/null
find_bin
