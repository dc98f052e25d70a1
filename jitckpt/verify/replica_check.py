"""Do the data-parallel replicas hold the same state? Compared through the job's store.

Every rank posts its state fingerprint's digest (verify/fingerprint.py) and the shard
it holds, sealed under the job token, at a key named for the check (its
attempt and label, e.g. the step), and waits for every rank's post. Ranks
with equal shards are replicas and must agree. Only when some do not, every
rank posts its per-tensor sums too, so the verdict can name the first tensor
that differs and, with three or more replicas of a shard, the odd one(s)
out: the ranks outside a strict majority. Every rank reads the same records,
so every rank reaches the same verdict and acts the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from ..wire import auth
from .fingerprint import Fingerprint

POST = auth.Schema({"shard": str, "digest": str}, {"next": int})
DETAIL = auth.Schema({"names": list, "sums": list})


class RecordTampered(RuntimeError):
    def __init__(self, rank: int, what: str) -> None:
        super().__init__(f"rank {rank}'s {what} does not verify under the job token: something outside the job "
                         "wrote to its store (see the README's threat model)")


@dataclass
class ShardVerdict:
    shard: str
    groups: dict[str, list[int]]  # digest -> ranks holding it
    majority: str | None  # the digest of a strict majority of the shard's replicas, if any
    tensor: str  # the first tensor (fixed order) where the groups differ

    @property
    def odd(self) -> list[int]:
        """Ranks outside the strict majority (none without one)."""
        if self.majority is None:
            return []
        return sorted(r for d, rs in self.groups.items() if d != self.majority for r in rs)

    def describe(self) -> str:
        groups = "; ".join(f"ranks {rs} hold {d[:12]}" for d, rs in self.groups.items())
        odd = f"; odd one(s) out: ranks {self.odd}" if self.odd else ""
        return f"shard {self.shard}: {groups}; first differing tensor {self.tensor!r}{odd}"


@dataclass
class Verdict:
    digests: dict[str, str]  # shard -> digest of the replicas that agree (all shards when ok)
    replicas: dict[str, list[int]]  # shard -> its ranks
    mismatches: list[ShardVerdict] = field(default_factory=list)
    details: dict[int, Fingerprint] = field(default_factory=dict)  # rank -> per-tensor sums (mismatch only)
    next: int | None = None  # the largest interval to the next periodic check the ranks proposed

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def compared(self) -> bool:
        """Some shard had two or more replicas: the check meant something."""
        return any(len(rs) > 1 for rs in self.replicas.values())

    def describe(self) -> str:
        return " | ".join(m.describe() for m in self.mismatches)

    def odd_ranks(self) -> list[int]:
        return sorted(r for m in self.mismatches for r in m.odd)


def _wait_all(a: auth.Auth, store, world: int, timeout_s: float, *parts: object) -> list[str]:
    keys = [a.key(*parts, r) for r in range(world)]
    store.wait(keys, timedelta(seconds=timeout_s))
    return keys


def compare(store, token: str, label: tuple, rank: int, world: int, shard: str, fp: Fingerprint,
            timeout_s: float, propose: int | None = None) -> Verdict:
    """Post ``fp`` for ``rank``; wait for every rank; the verdict (the same on every rank).
    ``label`` must name this check uniquely within the job (attempt, what, step). ``propose``:
    this rank's wish for the minibatches to the next periodic check (the verdict's ``next``: the
    largest one posted)."""
    a = auth.of(token)
    a.put(store, {"shard": shard, "digest": fp.digest, **({"next": propose} if propose else {})}, "fp", *label,
          rank)
    posts = {}
    for r, k in enumerate(_wait_all(a, store, world, timeout_s, "fp", *label)):
        rec = a.open(k, store.get(k), f"rank {r}'s state fingerprint", POST)
        if rec is None:
            raise RecordTampered(r, "state fingerprint")
        posts[r] = rec
    replicas: dict[str, list[int]] = {}
    for r, rec in posts.items():
        replicas.setdefault(rec["shard"], []).append(r)
    groups = {s: _groups(posts, rs) for s, rs in replicas.items()}
    digests = {s: next(iter(g)) for s, g in groups.items() if len(g) == 1}
    bad = sorted(s for s, g in groups.items() if len(g) > 1)
    wishes = [int(rec["next"]) for rec in posts.values() if "next" in rec]
    verdict = Verdict(digests, replicas, next=max(wishes) if wishes else None)
    if not bad:
        return verdict
    a.put(store, {"names": list(fp.names), "sums": list(fp.sums)}, "fpd", *label, rank)
    details = {}
    for r, k in enumerate(_wait_all(a, store, world, timeout_s, "fpd", *label)):
        rec = a.open(k, store.get(k), f"rank {r}'s per-tensor fingerprint", DETAIL)
        if rec is None:
            raise RecordTampered(r, "per-tensor fingerprint")
        details[r] = Fingerprint(tuple(map(str, rec["names"])), tuple(map(str, rec["sums"])), posts[r]["digest"])
    verdict.details = details
    for s in bad:
        verdict.mismatches.append(_shard_verdict(s, groups[s], details))
    return verdict


def _groups(posts: dict[int, dict], ranks: list[int]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in ranks:
        out.setdefault(posts[r]["digest"], []).append(r)
    # largest group first, then by lowest rank: the same order on every rank
    return dict(sorted(out.items(), key=lambda kv: (-len(kv[1]), kv[1][0])))


def _shard_verdict(shard: str, groups: dict[str, list[int]], details: dict[int, Fingerprint]) -> ShardVerdict:
    total = sum(len(rs) for rs in groups.values())
    first, *others = groups.items()
    majority = first[0] if len(first[1]) * 2 > total else None
    ref = details[first[1][0]]
    names = [ref.first_difference(details[rs[0]]) for _, rs in others]
    order = {n: i for i, n in enumerate(ref.names)}
    tensor = min((n for n in names if n is not None), key=lambda n: order.get(n, len(order)), default="?")
    return ShardVerdict(shard, groups, majority, tensor)


def forget(store, token: str, label: tuple, rank: int) -> None:
    """Delete this rank's records of the check before the one every rank just posted: each
    rank reads a check's records before it posts the next one."""
    a = auth.of(token)
    for what in ("fp", "fpd"):
        try:
            store.delete_key(a.key(what, *label, rank))
        except Exception:  # a store without delete_key (tests' fakes): the records stay
            return
