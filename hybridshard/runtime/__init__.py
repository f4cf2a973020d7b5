"""The flat-parameter runtime: what ``hybridshard.shard`` builds and what runs in every training step.

Layers, lowest first; a module imports only from its own layer and those below it
(tests/test_architecture.py checks this; docs/architecture.md draws it):

1. ``trace``: where this rank is and what it issued (no communication);
2. ``faults``: lost and failing ranks, the watchdog, exits;
3. ``comm``: the collectives and their checks; ``comm.executors``: who issues them;
4. ``grads``: a unit's gradient reduction and its compression;
5. ``units``: strategies, wrapping, the flat layout and storage, one unit's states;
6. ``engine``: the runtime of one model (hooks, end of backward, ``no_sync``, ``comm_stats``);
7. ``optim``: gradient norm, loss scaler, optimizer state sliced across replicas;
8. ``setup``: :func:`hybridshard.shard` and what it runs once.
"""
