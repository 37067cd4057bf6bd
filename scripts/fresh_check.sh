#!/usr/bin/env bash
# `make fresh-check`: proves that the README's quick start works on a bare Debian 12.
# Bootstraps a minimal bookworm (debootstrap --variant=minbase) into build-fresh/root,
# copies the repository in (tracked files and untracked, unignored ones, as the working
# tree has them) with the `shared/` folder that sits beside it, and runs the README's
# commands there under chroot, as root, with a clean environment (no CUDA: the build must
# turn the backend off by itself). Prints the time taken and the packages setup installed.
#
# Needs root and the network. What the chroot gets from the host is only what lets it
# reach the same mirrors: DNS (resolv.conf, hosts), the apt sources and Acquire settings,
# extra CA certificates (a TLS-intercepting proxy) and /etc/pip.conf. Nothing of the
# build: every tool and library comes from the repository's own setup.
#
#   FRESH_DIR    where to build (default build-fresh; its root/ is recreated each run)
#   FRESH_SUITE  Debian suite (default bookworm)
#   FRESH_MIRROR mirror for debootstrap (default: the host's first Debian URI)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FRESH_DIR="$(realpath -m "${FRESH_DIR:-$REPO/build-fresh}")"
ROOT="$FRESH_DIR/root"
SUITE="${FRESH_SUITE:-bookworm}"
SHARED="$(realpath -m "$REPO/../shared")"
# The README's quick start. A bare Debian has no `make`; the README's way in is setup.sh.
STEPS='bash scripts/setup.sh && make demo && make test'

[[ "$(id -u)" == 0 ]] || { echo "fresh-check: needs root (debootstrap, chroot, mounts)" >&2; exit 1; }
if ! command -v debootstrap >/dev/null; then
  echo "fresh-check: installing debootstrap"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap
fi

host_mirror() {
  local uri
  uri="$(grep -hoE '^(URIs:|deb) +[^ ]+' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null |
         awk '{print $2}' | grep -E '/debian/?$' | head -n1 || true)"
  echo "${uri:-http://deb.debian.org/debian}"
}
MIRROR="${FRESH_MIRROR:-$(host_mirror)}"

mounts_under_root() { findmnt -rn -o TARGET | grep -E "^$ROOT(/|$)" || true; }
unmount_all() {
  local m
  # Deepest first; lazy, so a process still holding a file cannot keep the mount alive.
  for m in $(mounts_under_root | sort -r); do umount -l "$m" || true; done
}
trap unmount_all EXIT INT TERM

# Never delete through a live mount (a bound /dev would take the host's with it).
unmount_all
if [[ -n "$(mounts_under_root)" ]]; then
  echo "fresh-check: mounts under $ROOT remain; not deleting it" >&2
  exit 1
fi
rm -rf --one-file-system "$ROOT"
mkdir -p "$ROOT"

start=$(date +%s)
echo "fresh-check: debootstrap --variant=minbase $SUITE from $MIRROR"
debootstrap --variant=minbase "$SUITE" "$ROOT" "$MIRROR" > "$FRESH_DIR/debootstrap.log" 2>&1 ||
  { tail -n 30 "$FRESH_DIR/debootstrap.log"; exit 1; }
boot_done=$(date +%s)

# The host's way out to the mirrors.
cp /etc/resolv.conf /etc/hosts "$ROOT/etc/"
rm -f "$ROOT/etc/apt/sources.list"
cp /etc/apt/sources.list "$ROOT/etc/apt/" 2>/dev/null || true
for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list; do
  [[ -f "$f" ]] && grep -qE 'debian' "$f" && cp "$f" "$ROOT/etc/apt/sources.list.d/"
done
for f in /etc/apt/apt.conf.d/*; do
  [[ -f "$f" ]] && grep -q 'Acquire' "$f" && cp "$f" "$ROOT/etc/apt/apt.conf.d/"
done
mkdir -p "$ROOT/usr/local/share/ca-certificates"
cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/" 2>/dev/null || true
[[ -f /etc/pip.conf ]] && cp /etc/pip.conf "$ROOT/etc/"

# The repository as its working tree has it (uncommitted edits and new files included,
# ignored build outputs and the venv left out), and shared/ beside it.
mkdir -p "$ROOT/srv/dcpmla"
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard |
   tar --null -T - --ignore-failed-read -cf - 2>/dev/null) | tar -xf - -C "$ROOT/srv/dcpmla"
if [[ -d "$SHARED" ]]; then
  cp -a "$SHARED" "$ROOT/srv/shared"
else
  echo "fresh-check: no $SHARED beside the repository; the vector tests will fail" >&2
fi

mount -t proc proc "$ROOT/proc"
mount --rbind /sys "$ROOT/sys" && mount --make-rslave "$ROOT/sys"
mount --rbind /dev "$ROOT/dev" && mount --make-rslave "$ROOT/dev"

chroot "$ROOT" dpkg-query -W -f='${Package}\n' | sort > "$FRESH_DIR/packages.before"
echo "fresh-check: running in the chroot: $STEPS"
set +e
chroot "$ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  bash -c "cd /srv/dcpmla && { $STEPS; }" 2>&1 | tee "$FRESH_DIR/run.log"
rc=${PIPESTATUS[0]}
set -e
chroot "$ROOT" dpkg-query -W -f='${Package}\n' | sort > "$FRESH_DIR/packages.after"
end=$(date +%s)

comm -13 "$FRESH_DIR/packages.before" "$FRESH_DIR/packages.after" > "$FRESH_DIR/packages.added"
echo
echo "fresh-check: packages setup.sh asked for:"
grep -h '^setup: installing Debian packages:' "$FRESH_DIR/run.log" | sed 's/^setup: installing Debian packages: /  /' || true
echo "fresh-check: $(wc -l < "$FRESH_DIR/packages.added") Debian packages added in all (with dependencies;" \
     "list in $FRESH_DIR/packages.added)"
echo "fresh-check: Python tools in .venv: $(chroot "$ROOT" /srv/dcpmla/.venv/bin/python -m pip freeze 2>/dev/null | tr '\n' ' ')"
echo "fresh-check: debootstrap $((boot_done - start)) s, README steps $((end - boot_done)) s, total $((end - start)) s"
if ((rc == 0)); then echo "fresh-check: PASSED"; else echo "fresh-check: FAILED (exit $rc; log in $FRESH_DIR/run.log)"; fi
exit "$rc"
