#!/usr/bin/env bash
# Provision a CRIU that works on the running kernel. Idempotent.
#
#   scripts/build_criu.sh                 # fail (exit 1) with the reason when no CRIU can be had
#   scripts/build_criu.sh --best-effort   # print the reason, exit 0 (`make test`: CRIU tests then skip)
#
# Result: build/criu/criu, a symlink to the chosen binary. launcher/criu.py
# (jitrun) looks for $JITCKPT_CRIU, then build/criu/criu, then the per-machine
# cache below, then `criu` on PATH.
#
# Choice, in order:
#   1. build/criu/criu already there and working: nothing to do (the cached fast path, < 1 s);
#   2. the distribution's criu (installed, or installable when apt offers >= 4.0; bookworm's
#      3.17 fails at start on kernels of this era, vDSO layout) when `criu check` passes and it
#      can dump a process holding a TCP socket (kernels >= 6.16 broke that for unpatched CRIU);
#   3. CRIU 4.1.1 built from Debian trixie's criu_4.1.1.orig.tar.xz (sha256 verified) with
#      scripts/criu-passcred-eopnotsupp.patch, cached in $JITCKPT_CRIU_CACHE (default
#      $HOME/.cache/jitckpt/criu-4.1.1): per machine, survives `make clean` of the repo.
# Needs root (criu dumps need CAP_SYS_ADMIN; the build deps come from apt).
set -euo pipefail

BEST_EFFORT=0
[[ "${1:-}" == "--best-effort" ]] && BEST_EFFORT=1

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION=4.1.1
TARBALL="criu_${VERSION}.orig.tar.xz"
SHA256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
URLS=("https://deb.debian.org/debian/pool/main/c/criu/${TARBALL}"
      "http://deb.debian.org/debian/pool/main/c/criu/${TARBALL}"
      "https://snapshot.debian.org/archive/debian/20250801T000000Z/pool/main/c/criu/${TARBALL}")
PATCH="$ROOT/scripts/criu-passcred-eopnotsupp.patch"
CACHE="${JITCKPT_CRIU_CACHE:-${HOME:-/root}/.cache/jitckpt/criu-${VERSION}}"
LINK_DIR="$ROOT/build/criu"
LINK="$LINK_DIR/criu"
BUILD_DEPS=(build-essential pkg-config libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev
            protobuf-compiler libnl-3-dev libnet1-dev libcap-dev libbsd-dev libnftables-dev
            libgnutls28-dev uuid-dev)

say() { echo "build_criu: $*" >&2; }
fail() {
    say "$*"
    if (( BEST_EFFORT )); then
        say "continuing without CRIU: the CRIU tests will skip (\`make criu\` retries; \`jitrun doctor\` reports)"
        exit 0
    fi
    exit 1
}

[[ "$(id -u)" == 0 ]] || fail "needs root (criu dumps need CAP_SYS_ADMIN; build deps come from apt); run as root"
[[ "$(uname -m)" == x86_64 ]] || say "warning: only tested on x86_64, this is $(uname -m)"

# `criu check` plus a real dump of a process holding a TCP socket: check alone passes for an
# unpatched 4.1.1 on kernels >= 6.16, which then cannot dump any inet socket.
works() {
    local criu="$1" tmp pid rc=0
    [[ -x "$criu" ]] || return 1
    "$criu" check >/dev/null 2>&1 || { say "$criu: \`criu check\` fails"; return 1; }
    command -v python3 >/dev/null || return 0
    tmp="$(mktemp -d /tmp/jitckpt-criu-probe.XXXXXX)"
    # PID 1 of its own PID namespace, as jitckpt runs migratable workers (no --mount-proc:
    # a mount namespace of its own would have to be dumped too, see launcher/criu.py).
    unshare --pid --fork setsid python3 -c '
import socket, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
c = socket.create_connection(s.getsockname()); a, _ = s.accept()
open("'"$tmp"'/ready", "w").close()
time.sleep(60)' </dev/null >/dev/null 2>&1 9>&- &   # 9>&-: not the build lock (criu refuses held locks)
    pid=$!
    for _ in $(seq 100); do [[ -e "$tmp/ready" ]] && break; sleep 0.05; done
    local inner
    # unshare --fork: the namespace's PID 1 is unshare's child
    inner="$(cat "/proc/$pid/task/$pid/children" 2>/dev/null | awk '{print $1}' || true)"
    if [[ -z "$inner" || ! -e "$tmp/ready" ]]; then
        rc=1; say "probe process did not start"
    elif ! "$criu" dump -t "$inner" -D "$tmp" -o dump.log --shell-job --tcp-established \
            --network-lock nftables --leave-running >/dev/null 2>&1; then
        rc=1; say "$criu cannot dump a process holding a TCP socket here; its log ends:"
        tail -n 5 "$tmp/dump.log" >&2 || true
    fi
    kill -KILL "$pid" 2>/dev/null || true
    [[ -n "$inner" ]] && kill -KILL "$inner" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    rm -rf "$tmp"
    return $rc
}

link_to() {
    mkdir -p "$LINK_DIR"
    ln -sfn "$1" "$LINK"
    say "using $1 ($("$1" --version 2>/dev/null | head -1)); linked at ${LINK#"$ROOT"/}"
}

# 1. cached fast path: only `criu check` (the link was probed when made).
if [[ -x "$LINK" ]] && "$LINK" check >/dev/null 2>&1; then
    exit 0
fi

# 2. the distribution's criu.
sys_criu="$(PATH="$PATH:/usr/sbin:/sbin" command -v criu || true)"
if [[ -z "$sys_criu" ]]; then
    cand="$(apt-cache policy criu 2>/dev/null | awk '/Candidate:/ {print $2}')"
    if [[ -n "$cand" && "$cand" != "(none)" ]] && dpkg --compare-versions "$cand" ge 4.0; then
        say "installing the distribution's criu $cand"
        "$ROOT/scripts/apt_install.sh" criu >/dev/null 2>&1 || true
        sys_criu="$(PATH="$PATH:/usr/sbin:/sbin" command -v criu || true)"
    else
        say "distribution's criu is ${cand:-unavailable} (< 4.0 fails at start on this kernel): using CRIU $VERSION from source"
    fi
fi
if [[ -n "$sys_criu" && "$sys_criu" != "$LINK" ]] && works "$sys_criu"; then
    link_to "$sys_criu"
    exit 0
fi

# 3. CRIU 4.1.1 from source, cached per machine. flock: concurrent `make` runs share one build.
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
stamp="$VERSION $(sha256sum "$PATCH" | cut -d' ' -f1)"
if [[ -x "$CACHE/criu" && "$(cat "$CACHE/stamp" 2>/dev/null)" == "$stamp" ]] && "$CACHE/criu" check >/dev/null 2>&1; then
    link_to "$CACHE/criu"
    exit 0
fi

"$ROOT/scripts/apt_install.sh" "${BUILD_DEPS[@]}" >/dev/null \
    || fail "installing the build deps (${BUILD_DEPS[*]}) failed; install them by hand and re-run"

src="$CACHE/$TARBALL"
if ! echo "$SHA256  $src" | sha256sum -c --status 2>/dev/null; then
    rm -f "$src"
    for u in "${URLS[@]}"; do
        say "fetching $u"
        if curl -fsSL --retry 2 -o "$src.part" "$u" 2>/dev/null || wget -qO "$src.part" "$u" 2>/dev/null; then
            mv "$src.part" "$src"; break
        fi
    done
    if [[ ! -f "$src" ]]; then
        # A deb-src entry for trixie is the other documented way to get the tarball.
        say "pool download failed; trying apt-get source --download-only criu/trixie (needs a trixie deb-src entry)"
        (cd "$CACHE" && apt-get source --download-only criu/trixie >/dev/null 2>&1) || true
    fi
    [[ -f "$src" ]] || fail "cannot download $TARBALL (tried ${URLS[*]} and apt-get source); \
put it at $src by hand (sha256 $SHA256) and re-run"
    echo "$SHA256  $src" | sha256sum -c --status \
        || { got="$(sha256sum "$src" | cut -d' ' -f1)"; rm -f "$src"; \
             fail "$TARBALL sha256 mismatch: got $got, want $SHA256 (download corrupted or tampered with); re-run"; }
fi

work="$CACHE/src"
rm -rf "$work"
mkdir -p "$work"
tar -C "$work" -xf "$src"
cd "$work/criu-$VERSION"
patch -p1 -s < "$PATCH" || fail "cannot apply $PATCH to criu $VERSION"
say "building criu $VERSION in $PWD (make -j$(nproc) criu: ~40 s idle, a few minutes on busy cores)"
log="$CACHE/build.log"
if ! make -j"$(nproc)" criu >"$log" 2>&1; then
    tail -n 20 "$log" >&2
    fail "criu build failed (full log: $log); missing build deps? ${BUILD_DEPS[*]}"
fi
install -m 0755 criu/criu "$CACHE/criu.new"
mv -f "$CACHE/criu.new" "$CACHE/criu"
cd "$CACHE" && rm -rf "$work"   # the binary is all jitckpt needs (build log kept)
works "$CACHE/criu" || fail "the built criu ($CACHE/criu) does not work on kernel $(uname -r); see above"
echo "$stamp" > "$CACHE/stamp"   # only a probed build is reused
link_to "$CACHE/criu"
