#!/usr/bin/env bash
# Installs the Debian packages named on the command line that are not installed
# yet. Several `make` runs may start together on a fresh machine (CI runs two):
# apt-get fails at once (exit 100) when another holds dpkg's lock, so our runs
# queue on a lock of their own, re-check after the wait (the other run may have
# installed the package), and wait for apt runs that are not ours
# (DPkg::Lock::Timeout).
set -euo pipefail
lock=/var/lock/jitckpt-apt.lock
[[ -w "$(dirname "$lock")" ]] || lock="${TMPDIR:-/tmp}/jitckpt-apt.lock"
exec 9>"$lock"
flock 9
missing=()
for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
(( ${#missing[@]} )) || exit 0
echo "apt_install: installing ${missing[*]}" >&2
apt=(apt-get -o DPkg::Lock::Timeout=600 -qq)
"${apt[@]}" update
DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y "${missing[@]}"
