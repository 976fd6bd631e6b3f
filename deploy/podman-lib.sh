# Shared by deploy/podman-image.sh and the image tests' shell steps: podman on this kind of machine.
# Sourced, not run.

# podman with the runc runtime (crun stops with "cgroups in hybrid mode not supported" here)
podman_() { podman --runtime runc "$@"; }

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

# a minimal Debian bookworm with Python 3.11 and `python` on PATH, as the official image has
make_base() {
    local tag=$1 mirror root
    mirror=$(debian_mirror)
    [ -n "$mirror" ] || { echo "no Debian mirror in /etc/apt/sources*" >&2; return 2; }
    root=$(mktemp -d)
    echo "debootstrap bookworm from $mirror"
    debootstrap --variant=minbase --include=python3.11,python3.11-venv,ca-certificates,passwd \
        bookworm "$root" "$mirror" >/dev/null
    ln -sf /usr/bin/python3.11 "$root/usr/local/bin/python"
    ln -sf /usr/bin/python3.11 "$root/usr/local/bin/python3"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
        "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/*
    tar -C "$root" -c . | podman import --change 'CMD ["python"]' - "$tag" >/dev/null
    rm -rf "$root"
}

# one setting from pip's configuration (global.NAME or install.NAME), e.g. find-links
pip_setting() {
    python3 -m pip config list 2>/dev/null \
        | sed -n "s/^\(global\|install\)\.$1='\(.*\)'\$/\2/p" | xargs
}
