"""Sharded DCP checkpoints: reading them (dcp_io), save (sync or async) with atomic commit and resume (manager),
conversions (convert)."""
