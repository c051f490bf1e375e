"""Sharded DCP checkpoints: save (sync or async), atomic commit, resume."""
