"""The lifecycles of the two aggregates a person reads, as data: an operation (one
buyer message) and a reply job (one chat window), plus a job's delivery.

Each module holds its statuses as an enum and an explicit transition table. Every status
change goes through the table: Python writers call the aggregate's functions, which only
move rows whose status may move (``sources``); PL/pgSQL writers use the same sets, rendered
from these tables into ``shared/functions/00_states.sql`` (``python -m shared.state``), where a
trigger also refuses any transition the table does not allow, whoever writes it.
"""
