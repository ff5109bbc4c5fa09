"""The Redis contract both sides share (docs/schema.md): key names, the schema version,
the records and hashes the Lua scripts write, the ``Endpoint`` registry entry, and the
scripts themselves (``scripts/*.lua``). Writers (``poller.store``) and readers
(``poller.reader``) import it; it imports neither."""
