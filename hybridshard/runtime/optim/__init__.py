"""After backward, around the optimizer: ``grad_norm`` (``clip_grad_norm_``), ``grad_scaler``
(fp16 loss scaling agreed over the job) and ``replica_slices`` (optimizer state sharded across
replicas).
"""
