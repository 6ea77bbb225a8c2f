#!/bin/sh
# Runs a command (make test-stores' pytest) inside a private network namespace
# of its own: the loopback, plus a veth pair mc0 10.199.0.1/24 <-> mc1
# 10.199.0.2/24 for Mooncake's transfer engine, which refuses the loopback and
# would otherwise pick (and send to) the machine's own LAN address. Nothing the
# tests start can reach anything outside the namespace.
#
# Needs root (CI) or unprivileged user namespaces; without either, the command
# runs as it is and the Mooncake tests skip (KVSEAL_TEST_NETNS unset).
set -eu
if [ "${KVSEAL_TEST_NETNS:-}" = "" ]; then
    if unshare -n true 2>/dev/null; then
        KVSEAL_TEST_NETNS=setup exec unshare -n "$0" "$@"
    elif unshare -r -n true 2>/dev/null; then
        KVSEAL_TEST_NETNS=setup exec unshare -r -n "$0" "$@"
    fi
    echo "netns.sh: no private network namespace (not root): the Mooncake tests skip" >&2
    exec "$@"
fi
ip link set lo up
ip link add mc0 type veth peer name mc1
ip addr add 10.199.0.1/24 dev mc0
ip addr add 10.199.0.2/24 dev mc1
ip link set mc0 up
ip link set mc1 up
KVSEAL_TEST_NETNS=10.199.0.1,10.199.0.2 exec "$@"
