#!/usr/bin/env bash
# A Docker engine and the brokerha image on a machine without an image registry.
#
#   docker/engine.sh start        start dockerd unless an engine already answers
#   docker/engine.sh stop         stop the dockerd this script started (by its PID file), nothing else
#   docker/engine.sh status       say whether an engine answers, and whether it is ours
#   docker/engine.sh base-image   build the base image (Debian bookworm + python3) with
#                                 debootstrap and `docker import` (no registry needed)
#   docker/engine.sh wheels       build brokerha and its dependencies as wheels on the host
#                                 (into docker/wheels/; the host's pip has its configuration)
#   docker/engine.sh build        base-image + wheels + `docker build` of the node image
#   docker/engine.sh compose ...  Docker Compose with these arguments (`docker compose` if the
#                                 plugin is there, else `docker-compose`, which it installs
#                                 with apt if missing: Debian's package, version 1.29)
#
# Environment: BROKERHA_IMAGE (default brokerha:dev), BROKERHA_BASE_IMAGE (default
# brokerha-base:bookworm; set it to e.g. python:3.11-slim where a registry is reachable and
# `base-image` is skipped), BROKERHA_ENGINE_STATE (default /tmp/brokerha-docker-engine: PID
# file and dockerd's log), PYTHON (host Python for `wheels`, default .venv/bin/python),
# BROKERHA_IMAGE_LABEL (KEY=VALUE label for `build`; the tests label the source's digest).
#
# The engine is started as on these machines (no bridge, so no private-range addresses;
# containers use host networking on 127.0.0.1 ports): dockerd --storage-driver=vfs
# --bridge=none --iptables=false --ip6tables=false. It needs root. Exit codes: 0 done,
# 1 failure, 2 impossible here (not root, no dockerd and no apt-get) — tests skip on 2.
set -euo pipefail
CALLER_DIR=$(pwd)  # compose's -f paths are the caller's
cd "$(dirname "$0")"
DOCKER_DIR=$(pwd)
REPO=$(cd .. && pwd)
STATE=${BROKERHA_ENGINE_STATE:-/tmp/brokerha-docker-engine}
PIDFILE=$STATE/dockerd.pid
IMAGE=${BROKERHA_IMAGE:-brokerha:dev}
BASE=${BROKERHA_BASE_IMAGE:-brokerha-base:bookworm}
SUITE=bookworm

say() { echo "engine.sh: $*" >&2; }

engine_up() { docker info >/dev/null 2>&1; }

ours() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

need_root() {
    if [ "$(id -u)" != 0 ]; then
        say "$1 needs root (uid $(id -u)); run as root or start a Docker engine yourself"
        exit 2
    fi
}

apt_install() {  # apt_install COMMAND PACKAGE: install PACKAGE if COMMAND is missing
    command -v "$1" >/dev/null 2>&1 && return 0
    need_root "installing $2"
    command -v apt-get >/dev/null 2>&1 || { say "no $1 and no apt-get to install $2"; exit 2; }
    say "installing $2 (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >/dev/null
}

cmd_start() {
    if engine_up; then
        if ours; then say "engine running (started by this script, pid $(cat "$PIDFILE"))"
        else say "an engine is already running; using it (not ours: stop leaves it alone)"; fi
        return 0
    fi
    need_root "starting dockerd"
    apt_install dockerd docker.io
    command -v docker >/dev/null 2>&1 || apt_install docker docker.io
    mkdir -p "$STATE"
    say "starting dockerd (vfs, no bridge, no iptables); log $STATE/dockerd.log"
    setsid dockerd --storage-driver=vfs --bridge=none --iptables=false --ip6tables=false \
        >"$STATE/dockerd.log" 2>&1 < /dev/null &
    echo $! > "$PIDFILE"
    for _ in $(seq 1 300); do
        if engine_up; then say "engine ready (pid $(cat "$PIDFILE"))"; return 0; fi
        if ! ours; then break; fi
        sleep 0.1
    done
    say "dockerd did not come up; last lines of its log:"
    tail -n 20 "$STATE/dockerd.log" >&2 || true
    cmd_stop || true
    exit 1
}

cmd_stop() {
    if ! [ -f "$PIDFILE" ]; then
        say "no engine started by this script; nothing to stop"
        return 0
    fi
    pid=$(cat "$PIDFILE")
    if kill -0 "$pid" 2>/dev/null; then
        say "stopping dockerd pid $pid"
        kill -TERM "$pid"
        for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$pid" 2>/dev/null; then say "dockerd $pid still up after 15 s: SIGKILL"; kill -KILL "$pid"; fi
    fi
    rm -f "$PIDFILE"
}

cmd_status() {
    if engine_up; then
        if ours; then echo "running (ours, pid $(cat "$PIDFILE"))"; else echo "running (not ours)"; fi
    else
        echo "not running"
        return 3
    fi
}

debian_mirror() {
    # read from this machine's apt sources at run time; never written into the repository
    local uri=""
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        uri=$(awk '/^URIs:/ {for (i = 2; i <= NF; i++) if ($i !~ /security/) {print $i; exit}}' "$f")
        [ -n "$uri" ] && break
    done
    if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
        uri=$(awk '/^deb / && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /:\/\//) {print $i; exit}}' /etc/apt/sources.list)
    fi
    [ -n "$uri" ] || { say "no Debian mirror found in the apt sources"; exit 2; }
    echo "$uri"
}

cmd_base_image() {
    engine_up || { say "no engine: run '$0 start' first"; exit 1; }
    if docker image inspect "$BASE" >/dev/null 2>&1; then
        say "base image $BASE present"
        return 0
    fi
    if [ "$BASE" != "brokerha-base:bookworm" ]; then
        say "pulling $BASE"; docker pull "$BASE"; return 0
    fi
    need_root "debootstrap"
    apt_install debootstrap debootstrap
    local mirror rootfs
    mirror=$(debian_mirror)
    rootfs=$(mktemp -d /tmp/brokerha-rootfs.XXXXXX)
    say "debootstrap $SUITE (minbase + python3, python3-venv) into $rootfs"
    if ! debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            "$SUITE" "$rootfs" "$mirror" >"$STATE/debootstrap.log" 2>&1; then
        tail -n 20 "$STATE/debootstrap.log" >&2; rm -rf "$rootfs"; exit 1
    fi
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    chmod 0755 "$rootfs"  # mktemp made it 0700: it becomes the image's /
    say "docker import $BASE"
    tar -C "$rootfs" -c . | docker import -c 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
    rm -rf "$rootfs"
}

cmd_wheels() {
    local py=${PYTHON:-$REPO/.venv/bin/python}
    [ -x "$py" ] || py=python3
    rm -rf "$DOCKER_DIR/wheels"
    mkdir -p "$DOCKER_DIR/wheels"
    say "pip wheel $REPO -> docker/wheels (with $py)"
    "$py" -m pip wheel -q "$REPO" -w "$DOCKER_DIR/wheels"
}

cmd_build() {
    mkdir -p "$STATE"
    cmd_base_image
    cmd_wheels
    say "docker build -t $IMAGE (base $BASE)"
    local label=()
    [ -n "${BROKERHA_IMAGE_LABEL:-}" ] && label=(--label "$BROKERHA_IMAGE_LABEL")
    docker build -q --build-arg "BASE=$BASE" "${label[@]}" -t "$IMAGE" "$DOCKER_DIR" >/dev/null
    say "built $IMAGE"
}

cmd_compose() {
    cd "$CALLER_DIR"
    if docker compose version >/dev/null 2>&1; then exec docker compose "$@"; fi
    apt_install docker-compose docker-compose
    exec docker-compose "$@"
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    base-image) mkdir -p "$STATE"; cmd_base_image ;;
    wheels) cmd_wheels ;;
    build) cmd_build ;;
    compose) shift; cmd_compose "$@" ;;
    *) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 64 ;;
esac
