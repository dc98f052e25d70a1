"""Erasure-coded snapshots in the nodes' memory, the fallback when a failure
takes every replica of a shard (docs/ec.md): ``codec`` (Reed-Solomon through
Intel ISA-L), ``pack`` (a snapshot into stripes and chunk files), ``files``
and ``memory`` (where chunks live and how much of /dev/shm they may take),
``snapshot`` (taking them at minibatch starts) and ``restore`` (decoding one
inside ``get_checkpoint_path``). Nothing is imported here: a job without EC
snapshots never loads ISA-L.
"""
