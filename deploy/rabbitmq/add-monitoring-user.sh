#!/bin/sh
# KEDA's user on RabbitMQ (RABBITMQ_MANAGEMENT_URL): it reads queue lengths from the
# management API and can do nothing else. Run it where rabbitmqctl reaches the node:
#   kubectl -n chatqueue exec -i chatq-rabbitmq-server-0 -- \
#     env MONITOR_PASSWORD='<long random>' sh -s < deploy/rabbitmq/add-monitoring-user.sh
#   docker compose -f deploy/compose.yaml exec -T rabbitmq \
#     env MONITOR_PASSWORD='<long random>' sh -s < deploy/rabbitmq/add-monitoring-user.sh
# The monitoring tag alone is not enough: RabbitMQ 3.10 answers 401 to
# GET /api/queues/<vhost>/<queue> from a user with no access to the vhost, so KEDA would
# never see a queue grow. The user gets access to the vhost with empty permissions
# ('^$' matches no name: it can neither configure, write nor read any exchange or queue).
set -eu
: "${MONITOR_USER:=chatq-monitor}" "${MONITOR_PASSWORD:?set MONITOR_PASSWORD}" "${VHOST:=/}"
if rabbitmqctl -q list_users | cut -f1 | grep -qx "$MONITOR_USER"; then
  rabbitmqctl -q change_password "$MONITOR_USER" "$MONITOR_PASSWORD"
else
  rabbitmqctl -q add_user "$MONITOR_USER" "$MONITOR_PASSWORD"
fi
rabbitmqctl -q set_user_tags "$MONITOR_USER" monitoring
rabbitmqctl -q set_permissions -p "$VHOST" "$MONITOR_USER" '^$' '^$' '^$'
echo "$MONITOR_USER: tag monitoring, vhost $VHOST with empty permissions"
