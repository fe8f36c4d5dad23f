"""The Grafana dashboards of deploy/grafana/dashboards, as code: `python deploy/grafana/build_dashboards.py`
rewrites them; a unit test keeps the JSON equal to this. Queries read only metrics the
services and RabbitMQ export (checked by tests)."""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "prometheus"}
RI = "$__rate_interval"
UNF = 'state=~"accepted|queued|waiting|replying"'


def panel(pid, title, kind, targets, x, y, w=6, h=6, unit=None, desc=""):
    p = {
        "id": pid,
        "title": title,
        "type": kind,
        "datasource": DS,
        "description": desc,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": [
            {"refId": chr(65 + i), "datasource": DS, "expr": e, "legendFormat": lf}
            for i, (e, lf) in enumerate(targets)
        ],
        "fieldConfig": {"defaults": {"unit": unit or "short"}, "overrides": []},
        "options": {},
    }
    if kind == "stat":
        p["options"] = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        }
    else:
        p["options"] = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    return p


def row(pid, title, y):
    return {
        "id": pid,
        "type": "row",
        "title": title,
        "collapsed": False,
        "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
        "panels": [],
    }


def dash(uid, title, desc, panels, tags):
    return {
        "uid": uid,
        "title": title,
        "description": desc,
        "tags": tags,
        "editable": False,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "",
        "graphTooltip": 1,
        "annotations": {"list": []},
        "templating": {"list": []},
        "links": [],
        "panels": panels,
    }


QUEUES = 'queue=~"chatq\\\\..+"'
backlog = f"sum(max by (state) (chatq_backlog{{{UNF}}}))"
CHATQUEUE = [
    row(1, "The four numbers", 0),
    panel(
        2,
        "Backlog (unfinished messages)",
        "stat",
        [(backlog, "unfinished")],
        0,
        1,
        w=5,
        h=5,
        desc="Messages received and not yet answered. Growing for long: the workers do not keep up.",
    ),
    panel(
        3,
        "Receipt-to-reply p95",
        "stat",
        [
            (
                "histogram_quantile(0.95, sum by (le) (rate(chatq_receipt_to_reply_seconds_bucket[15m])))",
                "p95",
            )
        ],
        5,
        1,
        w=5,
        h=5,
        unit="s",
        desc="From the platform's webhook to the platform accepting the reply; includes the human-like pause.",
    ),
    panel(
        4,
        "Failed share (range)",
        "stat",
        [
            (
                'sum(increase(chatq_operations_total{outcome=~"failed|needs_review"}[$__range])) / clamp_min(sum(increase(chatq_operations_total{outcome=~"replied|failed|needs_review"}[$__range])), 1)',
                "failed share",
            )
        ],
        10,
        1,
        w=5,
        h=5,
        unit="percentunit",
        desc="Failed or needs-review among finished messages over the dashboard's time range. A jump means access broke.",
    ),
    panel(
        5,
        "Retries (24 h)",
        "stat",
        [('sum(increase(chatq_retries_total{reason!~"busy|reconcile_wait|account_paused"}[1d]))', "retries")],
        15,
        1,
        w=4,
        h=5,
        desc="Automatic retries after a failed attempt, and a person's retries (reason person). "
        "Jobs waiting behind a busy chat, a reconcile or a paused account are not retries.",
    ),
    panel(
        6,
        "Oldest unfinished",
        "stat",
        [(f"max(chatq_oldest_unfinished_age_seconds{{{UNF}}})", "age")],
        19,
        1,
        w=5,
        h=5,
        unit="s",
        desc="How long the longest-waiting buyer has waited for an answer.",
    ),
    row(7, "Flow", 6),
    panel(
        8, "Backlog by state", "timeseries", [("max by (state) (chatq_backlog)", "{{state}}")], 0, 7, w=8, h=8
    ),
    panel(
        9,
        "Receipt-to-reply time",
        "timeseries",
        [
            (
                f"histogram_quantile(0.5, sum by (le) (rate(chatq_receipt_to_reply_seconds_bucket[{RI}])))",
                "p50",
            ),
            (
                f"histogram_quantile(0.95, sum by (le) (rate(chatq_receipt_to_reply_seconds_bucket[{RI}])))",
                "p95",
            ),
        ],
        8,
        7,
        w=8,
        h=8,
        unit="s",
    ),
    panel(
        10,
        "Outcomes per second",
        "timeseries",
        [(f"sum by (outcome) (rate(chatq_operations_total[{RI}]))", "{{outcome}}")],
        16,
        7,
        w=8,
        h=8,
        unit="ops",
    ),
    panel(
        11,
        "Webhooks per second",
        "timeseries",
        [(f"sum by (platform, outcome) (rate(chatq_webhooks_total[{RI}]))", "{{platform}} {{outcome}}")],
        0,
        15,
        w=8,
        h=8,
        unit="reqps",
    ),
    panel(
        12,
        "Webhook answer time p99",
        "timeseries",
        [
            (
                f"histogram_quantile(0.99, sum by (le, platform) (rate(chatq_webhook_seconds_bucket[{RI}])))",
                "{{platform}}",
            )
        ],
        8,
        15,
        w=8,
        h=8,
        unit="s",
    ),
    panel(
        13,
        "Outbox lag and pending rows",
        "timeseries",
        [
            ("max(chatq_outbox_lag_seconds)", "oldest unpublished row (s)"),
            # Every receiver and coalescer counts the same outbox table: max, not sum.
            ("max(chatq_outbox_pending)", "pending rows"),
        ],
        16,
        15,
        w=8,
        h=8,
        desc="Rows in Postgres not yet confirmed by RabbitMQ. Lag above a minute: the broker is down or blocked.",
    ),
    panel(
        14,
        "Outbox insert-to-confirm p99",
        "timeseries",
        [
            (
                f"histogram_quantile(0.99, sum by (le) (rate(chatq_outbox_publish_delay_seconds_bucket[{RI}])))",
                "p99",
            )
        ],
        0,
        23,
        w=8,
        h=8,
        unit="s",
    ),
    panel(
        15,
        "Coalescer emission lag",
        "timeseries",
        [
            (
                f"histogram_quantile(0.5, sum by (le) (rate(chatq_coalescer_emission_lag_seconds_bucket[{RI}])))",
                "p50",
            ),
            (
                f"histogram_quantile(0.99, sum by (le) (rate(chatq_coalescer_emission_lag_seconds_bucket[{RI}])))",
                "p99",
            ),
        ],
        8,
        23,
        w=8,
        h=8,
        unit="s",
        desc="From a window falling due to its reply job being emitted.",
    ),
    panel(
        16,
        "Open windows and queue depth",
        "timeseries",
        [
            ("max(chatq_coalescer_open_windows)", "open windows"),
            ('sum by (queue) (rabbitmq_queue_messages{queue=~"chatq\\\\..+"})', "{{queue}}"),
        ],
        16,
        23,
        w=8,
        h=8,
    ),
    row(17, "Platforms and the model", 31),
    panel(
        18,
        "Platform request time p95",
        "timeseries",
        [
            (
                f"histogram_quantile(0.95, sum by (le, platform) (rate(chatq_platform_request_seconds_bucket[{RI}])))",
                "{{platform}}",
            )
        ],
        0,
        32,
        w=8,
        h=8,
        unit="s",
    ),
    panel(
        19,
        "Platform errors per second",
        "timeseries",
        [
            (
                f'sum by (platform, outcome) (rate(chatq_platform_request_seconds_count{{outcome!="ok"}}[{RI}]))',
                "{{platform}} {{outcome}}",
            )
        ],
        8,
        32,
        w=8,
        h=8,
        unit="reqps",
    ),
    panel(
        20,
        "Model request time p95",
        "timeseries",
        [
            (
                f"histogram_quantile(0.95, sum by (le, outcome) (rate(chatq_llm_request_seconds_bucket[{RI}])))",
                "{{outcome}}",
            )
        ],
        16,
        32,
        w=8,
        h=8,
        unit="s",
    ),
    panel(
        21,
        "Retries by reason",
        "timeseries",
        [(f"sum by (reason) (rate(chatq_retries_total[{RI}]))", "{{reason}}")],
        0,
        40,
        w=12,
        h=8,
        unit="ops",
    ),
    panel(
        22,
        "Alerts announced",
        "timeseries",
        [(f"sum by (event, outcome) (rate(chatq_alerts_total[{RI}]))", "{{event}} {{outcome}}")],
        12,
        40,
        w=12,
        h=8,
        unit="ops",
    ),
]
RABBITMQ = [
    row(1, "Broker", 0),
    panel(
        2,
        "Ready messages by queue",
        "timeseries",
        [(f"sum by (queue) (rabbitmq_queue_messages_ready{{{QUEUES}}})", "{{queue}}")],
        0,
        1,
        w=12,
        h=8,
    ),
    panel(
        3,
        "Unacknowledged by queue",
        "timeseries",
        [(f"sum by (queue) (rabbitmq_queue_messages_unacked{{{QUEUES}}})", "{{queue}}")],
        12,
        1,
        w=12,
        h=8,
    ),
    panel(
        4,
        "Consumers by queue",
        "timeseries",
        [(f"sum by (queue) (rabbitmq_queue_consumers{{{QUEUES}}})", "{{queue}}")],
        0,
        9,
        w=8,
        h=8,
    ),
    panel(
        5,
        "Published and delivered per second",
        "timeseries",
        [
            (f"sum(rate(rabbitmq_global_messages_received_total[{RI}]))", "published"),
            (f"sum(rate(rabbitmq_global_messages_delivered_total[{RI}]))", "delivered"),
            (f"sum(rate(rabbitmq_global_messages_acknowledged_total[{RI}]))", "acked"),
            (f"sum(rate(rabbitmq_global_messages_redelivered_total[{RI}]))", "redelivered"),
            (
                f"sum(rate(rabbitmq_global_messages_dead_lettered_delivery_limit_total[{RI}])) + sum(rate(rabbitmq_global_messages_dead_lettered_rejected_total[{RI}]))",
                "dead-lettered",
            ),
        ],
        8,
        9,
        w=8,
        h=8,
        unit="ops",
    ),
    panel(
        6,
        "Connections and channels",
        "timeseries",
        [("sum(rabbitmq_connections)", "connections"), ("sum(rabbitmq_channels)", "channels")],
        16,
        9,
        w=8,
        h=8,
    ),
    panel(
        7,
        "Memory used vs limit",
        "timeseries",
        [
            ("sum by (instance) (rabbitmq_process_resident_memory_bytes)", "{{instance}} used"),
            ("sum by (instance) (rabbitmq_resident_memory_limit_bytes)", "{{instance}} limit"),
        ],
        0,
        17,
        w=12,
        h=8,
        unit="bytes",
    ),
    panel(
        8,
        "Free disk vs limit",
        "timeseries",
        [
            ("sum by (instance) (rabbitmq_disk_space_available_bytes)", "{{instance}} free"),
            ("sum by (instance) (rabbitmq_disk_space_available_limit_bytes)", "{{instance}} limit"),
        ],
        12,
        17,
        w=12,
        h=8,
        unit="bytes",
    ),
]


def render() -> dict[str, str]:
    chatqueue = dash(
        "chatqueue",
        "chatqueue",
        "The four numbers a seller watches, and where time goes.",
        CHATQUEUE,
        ["chatqueue"],
    )
    rabbitmq = dash(
        "chatqueue-rabbitmq",
        "chatqueue — RabbitMQ",
        "chatqueue's queues and the broker's health, from the rabbitmq_prometheus plugin. For the full picture import RabbitMQ's official 'RabbitMQ-Overview' dashboard (grafana.com 10991).",
        RABBITMQ,
        ["chatqueue", "rabbitmq"],
    )
    return {
        name: json.dumps(d, indent=2) + "\n"
        for name, d in (("chatqueue.json", chatqueue), ("rabbitmq.json", rabbitmq))
    }


if __name__ == "__main__":
    for name, text in render().items():
        (HERE / "dashboards" / name).write_text(text)
