#!/usr/bin/env bash
# Install redis-server and redis-cli from the distribution's packages (the tests start their own
# instances, and build their own Redis Cluster with redis-cli).
set -euo pipefail
if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then exit 0; fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq redis-server redis-tools >/dev/null
# The package starts a system service on port 6379; the tests never use it.
command -v redis-server
command -v redis-cli
