"""Who issues a model's collectives: the :class:`~hybridshard.runtime.comm.executors.base.Executor`
protocol, ``threads`` (a communication thread, CPU/gloo), ``streams`` (CUDA streams), ``emulate``
(the stream executor on an emulated device) and ``select`` (which one a model gets).
"""
