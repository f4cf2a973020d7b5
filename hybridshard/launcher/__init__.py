"""Launching: resolve a node's place in the job (options, SLURM), build torchrun's command, bind
workers to their GPU's NUMA node, and run a whole multi-host job on one machine
(:mod:`hybridshard.launcher.local_cluster`)."""
