"""Hang detection's worker side (docs/hangs.md): ``bound`` (the learned rule), ``waits`` (each
collective wait timed), ``status`` (the memory-mapped record the agent reads).
"""
