"""What :func:`hybridshard.shard` does once: arguments and groups (``api``), every rank the same model
(``model_check``), one unit's layout and storage (``build``), meta init (``deferred_init``), the
state-dict guard (``state_guard``) and per-block compile (``compile``).
"""
