#!/usr/bin/env bash
# Install Debian's chromium (headless) for the inspector's browser tests (tests/ui), which drive it
# through the DevTools protocol. Playwright's own browser download is not used.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then exit 0; fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq chromium >/dev/null
command -v chromium
