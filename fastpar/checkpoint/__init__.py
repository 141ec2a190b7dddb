"""Sharded checkpoints: every rank writes what it owns, in parallel, and loads into any layout.

See ``fastpar.checkpoint.sharded`` (save and load), ``boxes`` (where pieces sit in the serial
tensors), ``holdings`` (what a rank owns), ``writers`` (who writes what), ``files`` (the
on-disk format), ``store`` (the atomic directory protocol, shared with the serial format of
``fastpar.checkpoint.serial``), and ``python -m fastpar.checkpoint inspect|export``
(``__main__``).
"""
