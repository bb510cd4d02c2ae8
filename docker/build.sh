#!/usr/bin/env bash
# Build the images with the pip configuration of this machine: its index URLs (http/https) become build arguments,
# its CA bundle (`cert`, for TLS through a proxy) a build secret, and the wheels of its local find-links folders are linked into docker/wheels/ (a --find-links source the
# Dockerfile mounts during its pip install), so the image takes the torch wheel `pip install torch==2.13.0` takes
# here (the CPU one where pip is set up as docs/development.md says). file:// indexes cannot reach a build and are
# left out (say so); everything else comes from PyPI.
#   docker/build.sh                                   # raysim:0.1.0 and raysim-mlflow:3.17.2 on Ray's / Python's images
#   docker/build.sh --base raysim-base:bookworm       # both on the local Debian base, and raysim-postgres:15
#   docker/build.sh --no-data                         # no Fashion-MNIST in the image (WITH_DATA=0)
# Environment: DOCKER (the docker CLI; it needs BuildKit: Docker 23+ with buildx, or 20.10 with DOCKER_BUILDKIT=1),
# PIP (the pip whose configuration is read, default: python3 -m pip).
set -euo pipefail
cd "$(dirname "$0")/.."

DOCKER=${DOCKER:-docker}
PIP=${PIP:-python3 -m pip}
BASE="" DATA=1
while [ $# -gt 0 ]; do
  case $1 in
    --base) BASE=$2; shift 2 ;;
    --no-data) DATA=0; shift ;;
    *) echo "build.sh: unknown argument $1 (allowed: --base IMAGE, --no-data)" >&2; exit 2 ;;
  esac
done

# pip's value of a setting: $PIP_<NAME> first, else `pip config list` (user, then global/site files).
setting() {
  local env_name="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
  if [ -n "${!env_name:-}" ]; then echo "${!env_name}"; return; fi
  $PIP config list 2>/dev/null | sed -n "s/^[a-z:]*\.$1='\(.*\)'$/\1/p" | tail -1
}

pip_args=()
links=()
for name in index-url extra-index-url find-links; do
  keep=()
  for value in $(setting "$name"); do
    case $value in
      http://* | https://*) keep+=("$value") ;;
      file://*) [ "$name" = find-links ] && [ -d "${value#file://}" ] && links+=("${value#file://}") \
        || echo "build.sh: leaving out pip's $name $value (a local index cannot reach the build)" ;;
      *) if [ -d "$value" ]; then links+=("$value"); else echo "build.sh: leaving out pip's $name $value"; fi ;;
    esac
  done
  if [ ${#keep[@]} -gt 0 ]; then pip_args+=(--build-arg "PIP_$(echo "$name" | tr 'a-z-' 'A-Z_')=${keep[*]}"); fi
done
for folder in "${links[@]}"; do
  for wheel in "$folder"/*.whl; do
    [ -e "$wheel" ] || continue
    [ -e "docker/wheels/$(basename "$wheel")" ] || ln "$wheel" docker/wheels/ 2>/dev/null || cp "$wheel" docker/wheels/
    echo "build.sh: wheel $(basename "$wheel") from pip's find-links $folder"
  done
done

cert=$(setting cert)
if [ -n "$cert" ] && [ -f "$cert" ]; then
  pip_args+=(--secret "id=pip_cert,src=$cert")
  echo "build.sh: pip's cert $cert as the build secret pip_cert"
fi

base_args=()
[ -n "$BASE" ] && base_args=(--build-arg "BASE_IMAGE=$BASE")
export DOCKER_BUILDKIT=1
$DOCKER build -f docker/Dockerfile "${pip_args[@]}" "${base_args[@]}" --build-arg "WITH_DATA=$DATA" -t raysim:0.1.0 .
$DOCKER build -f docker/Dockerfile.mlflow "${pip_args[@]}" "${base_args[@]}" -t raysim-mlflow:3.17.2 .
if [ -n "$BASE" ]; then
  $DOCKER build -f docker/Dockerfile.postgres "${base_args[@]}" -t raysim-postgres:15 .
fi
