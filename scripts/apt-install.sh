#!/bin/sh
# Install Debian packages the tests need where they are missing: as root, or through
# passwordless sudo (a newcomer's machine). Otherwise say what to install and fail, so the
# caller can decide whether that stops it. Used by the Makefile's install steps.
#   scripts/apt-install.sh PACKAGE...
set -eu
# Installed, each of them: not merely known to dpkg (a removed package keeps its config).
installed=1
for package in "$@"; do
  [ "$(dpkg-query -W -f='${db:Status-Status}' "$package" 2>/dev/null)" = installed ] || installed=0
done
[ "$installed" = 1 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install these packages (no apt-get here): $*" >&2
  exit 1
fi
if [ "$(id -u)" = 0 ]; then
  as_root=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root="sudo -n"
else
  echo "as root, run: apt-get install $*" >&2
  exit 1
fi
echo "installing from Debian's packages: $*" >&2
$as_root apt-get update -qq
$as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
