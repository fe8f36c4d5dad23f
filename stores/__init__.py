"""One package per aggregate whose state the services change: ``operations`` (a buyer's
message and what became of it, as a person's commands change it), ``windows`` (a chat's
debounce window, from filing to emission), ``jobs`` (a reply job, from claim to record),
``accounts`` (the sellers' accounts: the registry every process reads, and whether the bot
may send on each). Each holds its interface (``protocol``: Protocols and the values they
trade), its Postgres implementation (``postgres``, on its SQL functions in ``functions/``),
and an in-memory fake (``fake``) under the same transition tables (shared/state).
tests/contract runs one set of test bodies against the fake and Postgres, so unit tests on
the fake say what Postgres does."""
