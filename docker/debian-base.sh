#!/usr/bin/env bash
# A Debian bookworm base image built locally from Debian's packages, for machines that cannot pull
# rayproject/ray or python:3.11-slim (an offline cluster with a Debian mirror, or this project's build machines).
# It keeps the contract of Ray's image that docker/Dockerfile relies on: a user `ray` (uid 1000, group users) with
# its home /home/ray, and `python`/`pip` on PATH (a venv that user owns, Debian's Python 3.11 as in
# rayproject/ray:2.60.0-py311-cpu). procps gives Ray's `ps`-based process checks; ca-certificates lets pip use TLS.
#   sudo docker/debian-base.sh                    # -> raysim-base:bookworm
#   docker build -f docker/Dockerfile --build-arg BASE_IMAGE=raysim-base:bookworm -t raysim:0.1.0 .
# Environment: MIRROR (default: the first Debian mirror apt uses here, else deb.debian.org), SUITE (bookworm),
# TAG (raysim-base:bookworm), ROOTFS (a scratch directory, removed afterwards). Needs root, debootstrap and docker.
set -euo pipefail

SUITE=${SUITE:-bookworm}
TAG=${TAG:-raysim-base:$SUITE}
if [ -z "${MIRROR:-}" ]; then
  MIRROR=$(grep -hoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/* \
    2>/dev/null | head -1 | awk '{print $2}' || true)
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi
ROOTFS=${ROOTFS:-$(mktemp -d /var/tmp/raysim-rootfs.XXXXXX)}
trap 'rm -rf "$ROOTFS"' EXIT
chmod 755 "$ROOTFS"  # the image's / (mktemp makes it 0700: user ray could not reach /bin)

[ "$(id -u)" -eq 0 ] || { echo "debian-base.sh: debootstrap needs root" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "debian-base.sh: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }

debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,procps "$SUITE" "$ROOTFS" "$MIRROR"
cat > "$ROOTFS/etc/apt/sources.list" <<SOURCES
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb ${MIRROR%/debian*}/debian-security $SUITE-security main
SOURCES
chroot "$ROOTFS" useradd --create-home --uid 1000 --gid users --shell /bin/bash ray
chroot "$ROOTFS" su ray -c "python3 -m venv /home/ray/venv"  # pip from Debian's wheel: no network needed
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/usr/share/doc/* \
  "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/locale/*

tar -C "$ROOTFS" -c . | docker import \
  --change 'ENV PATH=/home/ray/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'USER ray' \
  --change 'WORKDIR /home/ray' \
  --change 'CMD ["bash"]' \
  - "$TAG"
echo "debian-base.sh: built $TAG from $MIRROR $SUITE"
