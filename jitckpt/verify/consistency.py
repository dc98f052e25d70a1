"""Refuse to train when the ranks of a job loaded different states.

Every rank posts what ``get_checkpoint_path()`` gave it (a step, "fresh" when
it asked and there was nothing, or nothing at all when it never asked) under
the job-wide attempt in the workers' store, then waits for every rank's post
and compares. Ranks that never asked (a drop-in script, or a script that loads
on rank 0 and broadcasts) are not compared. Runs once per process, in the main
thread, right before the first training step; the store client is the
reporter's (TCPStore clients serialize their own calls).
"""

from __future__ import annotations

from datetime import timedelta

from ..wire import auth

NOT_ASKED = None
FRESH = "fresh"


class StateDivergence(RuntimeError):
    def __init__(self, loaded: dict[int, object]) -> None:
        self.loaded = loaded
        groups: dict[str, list[int]] = {}
        for r, v in sorted(loaded.items()):
            groups.setdefault(str(v), []).append(r)
        desc = "; ".join(f"step {v}: ranks {rs}" for v, rs in groups.items())
        super().__init__(
            f"ranks loaded different checkpoints ({desc}); training on would mix states. "
            "No training step was taken. Each node must see a complete replica of the same step "
            "(check the jit dirs and the events of every node)")


LOADED = auth.Schema({"value": (int, str, type(None))})


class StateTampered(RuntimeError):
    def __init__(self, rank: int) -> None:
        super().__init__(f"the record of what rank {rank} loaded does not verify under the job token: something "
                         "outside the job wrote to its store (see the README's threat model). No training step "
                         "was taken")


def check_loaded(store, token: str, attempt: int, rank: int, world_size: int, value: object,
                 timeout_s: float) -> dict[int, object]:
    """Post ``value`` for ``rank``, wait for every rank, raise StateDivergence
    if two ranks that asked loaded different things; returns what each loaded."""
    a = auth.of(token)
    a.put(store, {"value": value}, "loaded", attempt, rank)
    keys = [a.key("loaded", attempt, r) for r in range(world_size)]
    store.wait(keys, timedelta(seconds=timeout_s))
    loaded = {}
    for r, k in enumerate(keys):
        rec = a.open(k, store.get(k), f"rank {r}'s loaded step", LOADED)
        if rec is None:  # unknown is not "the same": training on could mix states
            raise StateTampered(r)
        loaded[r] = rec["value"]
    asked = {r: v for r, v in loaded.items() if v is not NOT_ASKED}
    if len(set(map(str, asked.values()))) > 1:
        raise StateDivergence(asked)
    return loaded
