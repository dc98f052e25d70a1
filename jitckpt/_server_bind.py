"""Imported by the warm-start fork server only (one of its preload modules,
launcher/warm.py): the server dies with the jitrun agent that started it, and
its forked workers, bound to the server (jitckpt/parent_death.py), follow."""

import os
import signal

from . import parent_death
from .wire import contract

SERVER_PID = os.getpid()  # a forked worker's expected parent

if contract.AGENT_PID.get():
    parent_death.bind(signal.SIGKILL, contract.AGENT_PID.get(), contract.AGENT_PID.get())
