"""The flat-parameter runtime: what ``hybridshard.shard`` builds and what runs in every training step.

- ``api``: :func:`hybridshard.shard` (arguments, groups per strategy), with ``model_check`` (every
  rank shards the same model) and ``build`` (one unit's layout and storage, rank 0's values).
- ``layout`` (pure metadata), ``flat_param`` (storage and views), ``unit`` (one unit's states),
  ``changes`` (parameters changed while gathered), ``wrap`` (which modules become units),
  ``strategy`` (strategies and mixed precision).
- ``engine``: the runtime of one model (hooks, end of backward, ``no_sync``); ``prefetch``; ``compile``
  (``shard(..., compile=...)``: each block compiled, the hooks outside).
- The gradient path: ``reduce`` (what is reduced where), ``compression`` (the compressed replicate
  all-reduce), ``grad_norm``, ``grad_scaler`` (fp16 loss scaling agreed over the job).
- Executors, who issues the collectives: ``executor`` (the choice), ``overlap`` (a communication
  thread, CPU/gloo), ``streams`` (one issuing thread and CUDA streams), ``issue_order`` (recording
  the order collectives are issued in); ``offload`` (master shards in CPU memory).
- Communication: ``collectives``, ``counters`` and ``stats`` (what was moved), ``faults`` (naming
  lost ranks), ``agreement`` (the debug check) and ``position`` (where each rank is).

docs/architecture.md draws one training step through these modules.
"""
