#!/usr/bin/env bash
# `make image` on a machine with no container registry: builds the embedpool image with podman.
#
# On a normal machine with Docker and registry access none of this is needed:
#   docker build -t embedpool .
# Here (Debian bookworm, root, no registry, a local CPU torch wheel, a TLS-inspecting proxy) the
# script prepares what that command takes for granted, each step skipped when already done:
#   1. podman + runc + debootstrap from Debian's packages;
#   2. a base image with `python` (localhost/embedpool-base:bookworm-<recipe>) made by debootstrap
#      from the Debian mirror this machine's apt is configured with, unless PYTHON_IMAGE is already
#      local; <recipe> is a hash of deploy/podman-lib.sh's make_base and its package set, so a
#      changed recipe builds a new base instead of reusing an old one;
#   3. `podman build` with this machine's pip configuration (its CA bundle, its local wheel and
#      index folders) mounted at build time only -- nothing of it is copied into the image;
#   4. the images that build leaves untagged and labelled io.embedpool.part (its build stage,
#      2.7-3.2 GB; an image of the same tag it replaced) removed: on a machine that builds at every
#      CI run they filled the disk (a build then failed with "no space left on device").
# Environment: IMAGE (default localhost/embedpool:latest), EXTRAS (pyproject extras, e.g. ray),
# PYTHON_IMAGE, TORCH_VERSION, PODMAN_STORE (an image store of its own: deploy/podman-lib.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=deploy/podman-lib.sh
. deploy/podman-lib.sh

IMAGE=${IMAGE:-localhost/embedpool:latest}
OWN_BASE=localhost/embedpool-base:bookworm-$(base_recipe)
BASE=${PYTHON_IMAGE:-$OWN_BASE}
TORCH_VERSION=${TORCH_VERSION:-$(sed -n 's/^TORCH *:= *torch==//p' Makefile)}

ensure_engine

# A build writes ~5 GB into the image store (the build stage with torch, the image, the layers'
# copies while they are committed): refuse early, saying so, rather than fail half-way.
NEED_GB=${NEED_GB:-6}
store_dir=$(podman_ info --format '{{.Store.GraphRoot}}')
mkdir -p "$store_dir"
free_gb=$(df -P -BG "$store_dir" | awk 'NR == 2 {sub("G", "", $4); print $4}')
if [ "$free_gb" -lt "$NEED_GB" ]; then
    echo "only ${free_gb} GB free under $store_dir; an image build needs ${NEED_GB} GB." >&2
    echo "Free space (e.g. 'podman image prune', old images in 'podman images') and run again." >&2
    exit 2
fi

if ! podman_ image exists "$BASE"; then
    if [ "$BASE" != "$OWN_BASE" ]; then
        echo "PYTHON_IMAGE=$BASE is not a local image and no registry is reachable" >&2
        exit 2
    fi
    make_base "$BASE"
fi

# pip's configuration on this machine -> build-time mounts and a pip.conf for the build stage
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mounts=()
conf="$work/pip.conf"
echo "[global]" > "$conf"
cert=$(pip_setting cert)
cert=${cert:-${PIP_CERT:-${SSL_CERT_FILE:-}}}
if [ -n "$cert" ] && [ -f "$cert" ]; then
    mounts+=(-v "$cert:/etc/embedpool-build/ca.crt:ro")
    echo "cert = /etc/embedpool-build/ca.crt" >> "$conf"
fi
wheels=""
links=()
for dir in $(printf '%s\n' $(pip_setting find-links) ${PIP_FIND_LINKS:-} | sed 's|^file://||' | sort -u); do
    [ -d "$dir" ] || continue
    n=${#links[@]}
    mounts+=(-v "$dir:/wheels/$n:ro")
    links+=("/wheels/$n")
    if ls "$dir"/torch-"$TORCH_VERSION"*.whl >/dev/null 2>&1; then wheels="/wheels/$n"; fi
done
[ ${#links[@]} -eq 0 ] || echo "find-links = ${links[*]}" >> "$conf"
indexes=()
for url in $(pip_setting extra-index-url); do
    dir=${url#file://}
    if [ "$dir" != "$url" ] && [ -d "$dir" ]; then
        # a local index links its files relative to itself (../files/...): mount its parent
        n=${#indexes[@]}
        mounts+=(-v "$(dirname "$dir"):/indexes/$n:ro")
        indexes+=("file:///indexes/$n/$(basename "$dir")")
    fi
done
[ ${#indexes[@]} -eq 0 ] || echo "extra-index-url = ${indexes[*]}" >> "$conf"
mounts+=(-v "$conf:/etc/pip.conf:ro")

args=(--build-arg "PYTHON_IMAGE=$BASE" --build-arg "TORCH_VERSION=$TORCH_VERSION" --build-arg "EXTRAS=${EXTRAS:-}")
# the public CPU wheel index is not reachable here: the torch step takes the local wheel instead
[ -z "$wheels" ] || args+=(--build-arg "TORCH_WHEELS=$wheels")

echo "building $IMAGE${EXTRAS:+ with extras $EXTRAS} from $BASE (torch $TORCH_VERSION${wheels:+ from the local wheel folder})"
podman_ build --format docker --network host "${mounts[@]}" "${args[@]}" -t "$IMAGE" -f Dockerfile .
podman_ image inspect "$IMAGE" --format 'built {{.Id}} size {{.Size}} bytes'
podman_ image prune --force --filter label=io.embedpool.part | sed 's/^/removed untagged /'
