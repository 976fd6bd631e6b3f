# Shared by deploy/podman-image.sh and the image tests' shell steps: podman on this kind of machine.
# Sourced, not run.

# podman with the runc runtime (crun stops with "cgroups in hybrid mode not supported" here).
# PODMAN_STORE=DIR: an image store of its own under DIR (podman's --root and --runroot), empty
# at first -- the image tests build the base there, as on a machine that has none.
podman_() {
    local store=()
    [ -z "${PODMAN_STORE:-}" ] || store=(--root "$PODMAN_STORE/root" --runroot "$PODMAN_STORE/run")
    podman --runtime runc "${store[@]}" "$@"
}

# rlimits for `podman run`: podman's defaults can exceed this machine's hard limits, and the
# runtime then fails with "setrlimit ... Operation not permitted". Read them, never hard-code them:
# this shell's hard limits, processes capped at the kernel's pid_max (above it runc's setrlimit
# was refused here: 32768 passed, 65536 failed with a hard limit of 96363).
ulimits() {
    local n p max
    n=$(ulimit -Hn); p=$(ulimit -Hu); max=$(cat /proc/sys/kernel/pid_max)
    [ "$n" = unlimited ] && n=1048576
    { [ "$p" = unlimited ] || [ "$p" -gt "$max" ]; } && p=$max
    echo "--ulimit nofile=$n:$n --ulimit nproc=$p:$p"
}

# `podman run` with both
podman_run() {
    # shellcheck disable=SC2046
    podman_ run $(ulimits) "$@"
}

ensure_engine() {
    local missing=()
    command -v podman >/dev/null || missing+=(podman)
    command -v runc >/dev/null || missing+=(runc)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    [ ${#missing[@]} -eq 0 ] && return 0
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
}

# the first Debian mirror apt is configured with (deb822 .sources or one-line sources.list)
debian_mirror() {
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        awk '/^URIs:/ && $2 ~ /debian\/?$/ {print $2; exit}' "$f"
    done | head -n1 | grep . && return 0
    awk '$1 == "deb" && $2 !~ /^\[/ && $2 ~ /debian\/?$/ {print $2; exit}
         $1 == "deb" && $2 ~ /^\[/ && $3 ~ /debian\/?$/ {print $3; exit}' /etc/apt/sources.list 2>/dev/null
}

# What the base holds besides debootstrap's minbase: Python 3.11 with venv and pip (the
# Dockerfile's first step is `python -m venv`), TLS roots, and groupadd/useradd for its user.
# python3.11-venv depends on python3.11-distutils, a virtual package that only python3-distutils
# provides: apt resolves that, debootstrap does not ("Couldn't find these debs" for the virtual
# name, an unconfigured python3.11-venv without it), so the provider is named here.
BASE_PACKAGES=python3.11,python3.11-venv,python3-distutils,ca-certificates,passwd

# a minimal Debian bookworm with Python 3.11 and `python` on PATH, as the official image has.
# debootstrap's output goes to a log; when it fails, the log's end and debootstrap's own log
# (which names the package that did not install or configure) are printed.
make_base() {
    local tag=$1 mirror root log
    mirror=$(debian_mirror)
    [ -n "$mirror" ] || { echo "no Debian mirror in /etc/apt/sources*" >&2; return 2; }
    root=$(mktemp -d)
    log=$(mktemp)
    echo "debootstrap bookworm from $mirror with $BASE_PACKAGES (log: $log)"
    if ! debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$root" "$mirror" >"$log" 2>&1; then
        {
            echo "debootstrap failed; the end of its output:"
            tail -n 40 "$log"
            if [ -f "$root/debootstrap/debootstrap.log" ]; then
                echo "--- the end of $root/debootstrap/debootstrap.log:"
                tail -n 40 "$root/debootstrap/debootstrap.log"
            fi
        } >&2
        rm -rf "$root"
        return 1
    fi
    # the base must do what the Dockerfile asks of it before it is tagged
    if ! chroot "$root" /usr/bin/python3.11 -m venv --help >/dev/null 2>&1 \
        || ! chroot "$root" /usr/bin/python3.11 -c 'import ensurepip, ssl' 2>&1; then
        echo "the debootstrapped base lacks venv/ensurepip/ssl" >&2
        rm -rf "$root"
        return 1
    fi
    rm -f "$log"
    ln -sf /usr/bin/python3.11 "$root/usr/local/bin/python"
    ln -sf /usr/bin/python3.11 "$root/usr/local/bin/python3"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
        "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/*
    tar -C "$root" -c . | podman_ import --change 'CMD ["python"]' - "$tag" >/dev/null
    rm -rf "$root"
}

# 12 hex digits that change whenever make_base or its package set does (the base image's tag)
base_recipe() {
    { declare -f make_base; echo "$BASE_PACKAGES"; } | sha256sum | cut -c1-12
}

# one setting from pip's configuration (global.NAME or install.NAME), e.g. find-links
pip_setting() {
    python3 -m pip config list 2>/dev/null \
        | sed -n "s/^\(global\|install\)\.$1='\(.*\)'\$/\2/p" | xargs
}
