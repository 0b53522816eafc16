#!/bin/sh
# brokerha node entry point: configuration by file and by environment.
#
#   BROKERHA_CONFIG          TOML file (default /etc/brokerha/brokerha.toml; used if it exists)
#   BROKERHA_NAME            node name; for a cluster member, its name in [[cluster.nodes]]
#   BROKERHA_DATA            data directory (default /var/lib/brokerha, the volume)
#   BROKERHA_LISTEN          AMQP HOST:PORT (standalone; a member's comes from the file)
#   BROKERHA_ADMIN           admin HTTP HOST:PORT or "off" (default: AMQP port + 10000)
#   BROKERHA_LOG_LEVEL       debug | info | warning | error
#   BROKERHA_CLUSTER_SECRET  written to $BROKERHA_DATA/cluster-secret (mode 0600) for a
#                            configuration with secret_file = "/var/lib/brokerha/cluster-secret"
#   BROKERHA_TXLOG_SECRET    written to $BROKERHA_DATA/txlog-secret (mode 0600) for a [txlog]
#                            section with secret-file = "/var/lib/brokerha/txlog-secret"
#
# Arguments are passed on to `brokerha node`; a first argument that is not an option
# (e.g. `brokerha ctl ...`, `sh`) is run instead.
set -eu
case "${1:-}" in
    ""|-*) ;;
    *) PATH=/opt/brokerha/bin:$PATH exec "$@" ;;
esac
data=${BROKERHA_DATA:-/var/lib/brokerha}
mkdir -p "$data"
if [ -n "${BROKERHA_CLUSTER_SECRET:-}" ]; then
    (umask 077 && printf '%s\n' "$BROKERHA_CLUSTER_SECRET" > "$data/cluster-secret")
fi
if [ -n "${BROKERHA_TXLOG_SECRET:-}" ]; then
    (umask 077 && printf '%s\n' "$BROKERHA_TXLOG_SECRET" > "$data/txlog-secret")
fi
config=${BROKERHA_CONFIG:-/etc/brokerha/brokerha.toml}
if [ -f "$config" ]; then
    set -- --config "$config" "$@"
elif [ -n "${BROKERHA_CONFIG:-}" ] && [ "$config" != /etc/brokerha/brokerha.toml ]; then
    echo "brokerha-entrypoint: BROKERHA_CONFIG=$config does not exist" >&2
    exit 2
fi
[ -n "${BROKERHA_NAME:-}" ] && set -- --name "$BROKERHA_NAME" "$@"
[ -n "${BROKERHA_LISTEN:-}" ] && set -- --listen "$BROKERHA_LISTEN" "$@"
[ -n "${BROKERHA_ADMIN:-}" ] && set -- --admin "$BROKERHA_ADMIN" "$@"
[ -n "${BROKERHA_LOG_LEVEL:-}" ] && set -- --log-level "$BROKERHA_LOG_LEVEL" "$@"
cd "$data"
exec /opt/brokerha/bin/brokerha node --data "$data" "$@"
