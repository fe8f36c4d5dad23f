"""One package per platform (``telegram``, ``avito``, ``generic``, ``sandbox``): each holds
its webhook parsing (``webhook``: authenticate, parse, normalise to an ``inbound.Intake``)
and its sending adapter (``adapter``: one ``base.Platform``). What they share sits here:
the adapter interface (``base``), failure classes (``failures``), per-account rate limits
and Avito's shared budget (``ratelimit``), the guarded HTTP client for tenants' reply URLs
(``http``), media descriptions (``media``), the normalised inbound event (``inbound``) and
which adapter each account sends with (``accounts``). Services import these packages;
nothing here imports a service."""
