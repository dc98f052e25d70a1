"""Devices of this node's ranks: NVML health before every start and while the
job runs, a device lost under a live process, and what the scheduler hook is
told about either (``describe``)."""
