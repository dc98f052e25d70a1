"""Authentication of jitckpt's records in torch's store, under the job token.

torch's TCPStore has no authentication: whoever reaches its port can list, read
and write every key. So nothing jitckpt reads from the store is trusted unless it
verifies under the job token, and the token itself never goes there:

* key names are an HMAC of their label (``jitckpt/<32 hex>``): a stranger who lists
  the keys learns neither the token nor what a key is for, and cannot create the key
  of a future record before the job does;
* every record that steers the job is sealed: ``{"v": <value>, "mac": <hex>}``, the
  MAC an HMAC-SHA256 over the key name and the value's canonical JSON, so a sealed
  value cannot be replayed under another key;
* :meth:`Auth.open` never raises: a record that does not verify, or fails its
  :class:`Schema`, is ``None`` plus one line through the reject hook (the agent's
  events log; stderr in a worker).

Counters (``add``) and raw data chunks are not sealed: a forged counter only makes
a reader look at a slot whose record then does not verify, and transferred files
are checked against checksums that came in sealed records.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import sys
import threading
from collections.abc import Callable
from typing import Any

TOKEN_MIN_LEN = 16
MAX_RECORD = 16 << 20  # bytes: nothing of ours comes near; a bigger value is not parsed

_NONE = type(None)


def token_problem(token: str) -> str | None:
    """Why ``token`` cannot be a job token (None: it can). Printable ASCII only: it
    is passed through environments and command lines, and compared as bytes."""
    if not token:
        return "it is empty"
    if not all(33 <= ord(c) <= 126 for c in token):
        return "it may contain only printable ASCII characters, no spaces"
    if len(token) < TOKEN_MIN_LEN:
        return f"it has {len(token)} characters; use at least {TOKEN_MIN_LEN} (e.g. 32 hex digits)"
    return None


def job_token(given: str | None, max_nodes: int) -> str:
    """The job token: ``given`` (JITCKPT_TOKEN, the same on every node) or, for a
    one-node job, a random one that never leaves this node. ValueError with what to
    do otherwise: a token shared through the store would be readable by anyone who
    reaches it, which would make every seal worthless."""
    if given:
        why = token_problem(given)
        if why is not None:
            raise ValueError(f"JITCKPT_TOKEN in the environment cannot be the job token: {why}. Set it to the "
                             "same random value on every node, e.g. JITCKPT_TOKEN=$(python3 -c 'import secrets; "
                             "print(secrets.token_hex(16))')")
        return given
    if max_nodes > 1:
        raise ValueError("a job of more than one node needs JITCKPT_TOKEN, the same secret on every node: it "
                         "authenticates jitckpt's messages in torch's store, which anyone who reaches it can read "
                         "and write, so jitrun will not send the token there. Export it before starting jitrun on "
                         "each node (srun and mpirun pass it on), e.g. export JITCKPT_TOKEN=$(python3 -c "
                         "'import secrets; print(secrets.token_hex(16))')")
    import secrets

    return secrets.token_hex(16)


class Schema:
    """Required and optional keys of a dict record with their types (a type or a
    tuple of types; ``bool`` is never an ``int`` here); other keys are refused unless
    ``extra``. ``nested``: a function checking the record further, returning why not."""

    def __init__(self, required: dict[str, Any], optional: dict[str, Any] | None = None, *,
                 extra: bool = False, nested: Callable[[dict], str | None] | None = None) -> None:
        self.required = required
        self.optional = optional or {}
        self.extra = extra
        self.nested = nested

    def problem(self, rec: object) -> str | None:
        if not isinstance(rec, dict):
            return f"not an object but {type(rec).__name__}"
        for k, t in self.required.items():
            if k not in rec:
                return f"no {k!r}"
            if not is_a(rec[k], t):
                return f"{k!r} is {type(rec[k]).__name__}"
        for k, t in self.optional.items():
            if k in rec and not is_a(rec[k], t):
                return f"{k!r} is {type(rec[k]).__name__}"
        if not self.extra:
            odd = sorted(set(rec) - set(self.required) - set(self.optional))
            if odd:
                return f"unexpected key(s) {odd[:5]}"
        return self.nested(rec) if self.nested is not None else None


def is_a(v: object, t: Any) -> bool:
    ts = t if isinstance(t, tuple) else (t,)
    if isinstance(v, bool):
        return bool in ts
    if isinstance(v, int) and float in ts:
        return True
    return isinstance(v, tuple(x for x in ts if x is not bool))


def int_list(v: object) -> bool:
    return isinstance(v, list) and all(is_a(x, int) for x in v)


def canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


# -- what happens to a record that does not verify -----------------------------------------------

_hook_lock = threading.Lock()
_seen: set[tuple[str, str]] = set()


def _stderr_hook(what: str, why: str) -> None:
    print(f"jitckpt: ignored a record in the job's store ({what}): {why}", file=sys.stderr, flush=True)


_hook: Callable[[str, str], None] = _stderr_hook


def on_reject(hook: Callable[[str, str], None]) -> None:
    """Where rejections go (the agent: its events log). Each (what, why) once: a
    forged key polled every tick gives one line, not one per tick."""
    global _hook
    with _hook_lock:
        _hook = hook
        _seen.clear()


def reject(what: str, why: str) -> None:
    with _hook_lock:
        if (what, why) in _seen:
            return
        _seen.add((what, why))
        hook = _hook
    try:
        hook(what, why)
    except Exception:
        pass  # a full disk must not turn a rejected record into an agent crash


def reject_if(what: str, problem: str | None) -> bool:
    """True (after one reject line) when a verified record has a ``problem``."""
    if problem is None:
        return False
    reject(what, f"malformed: {problem}")
    return True


class Auth:
    """The job's namespace and seals, from its token."""

    def __init__(self, token: str) -> None:
        if not isinstance(token, str) or not token:
            raise ValueError("the job token is empty")
        self._key = token.encode("utf-8", "surrogatepass")

    def _mac(self, *parts: bytes) -> hmac.HMAC:
        return hmac.new(self._key, b"\0".join(parts), hashlib.sha256)

    def key(self, *parts: object) -> str:
        """The store key of the record labelled ``parts`` (e.g. "round", 3, "decision")."""
        label = "/".join(map(str, parts)).encode()
        return "jitckpt/" + self._mac(b"jitckpt-key", label).hexdigest()[:32]

    def seal(self, key: str, value: object) -> bytes:
        mac = self._mac(b"jitckpt-record", key.encode(), canonical(value)).hexdigest()
        return json.dumps({"v": value, "mac": mac}, separators=(",", ":"), allow_nan=False).encode()

    def mac(self, label: str, value: object) -> str:
        """A MAC for something sent outside the store (a stream header), bound to ``label``."""
        return self._mac(b"jitckpt-msg", label.encode(), canonical(value)).hexdigest()

    def check_mac(self, label: str, value: object, mac: object) -> bool:
        if not isinstance(mac, str) or len(mac) != 64:
            return False
        try:
            want = self.mac(label, value)
        except (TypeError, ValueError):
            return False
        return hmac.compare_digest(want.encode(), mac.encode("ascii", "replace"))

    def unseal(self, key: str, raw: object) -> tuple[Any, str | None]:
        """(value, None) if ``raw`` is a seal of ``key``, else (None, why)."""
        if isinstance(raw, str):
            raw = raw.encode("utf-8", "replace")
        if not isinstance(raw, (bytes, bytearray)):
            return None, "not bytes"
        if len(raw) > MAX_RECORD:
            return None, f"{len(raw)} bytes, more than any record of ours"
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):
            return None, "not JSON"
        if not isinstance(doc, dict) or set(doc) != {"v", "mac"} or not isinstance(doc["mac"], str):
            return None, "not a sealed record"
        try:
            want = self._mac(b"jitckpt-record", key.encode(), canonical(doc["v"])).hexdigest()
        except (TypeError, ValueError):
            return None, "not canonical JSON"
        if not hmac.compare_digest(want.encode(), doc["mac"].encode("ascii", "replace")):
            return None, "its MAC does not verify under the job token (forged, or another job's)"
        return doc["v"], None

    def checked(self, key: str, raw: object, what: str, schema: Schema | None = None) -> tuple[Any, str | None]:
        """(value, None) if ``raw`` read at ``key`` verifies (and fits ``schema``), else
        (None, why) after one reject line: :meth:`open` for callers that say why."""
        value, why = self.unseal(key, raw)
        if why is None and schema is not None:
            why = schema.problem(value)
            if why is not None:
                why = f"malformed: {why}"
        if why is not None:
            reject(what, why)
            return None, why
        return value, None

    def open(self, key: str, raw: object, what: str, schema: Schema | None = None) -> Any:
        """The verified value of ``raw`` read at ``key``, or None after one reject line."""
        return self.checked(key, raw, what, schema)[0]

    # -- store helpers (a TCPStore or anything with its check/get/set) --------------------------

    def put(self, store, value: object, *parts: object) -> str:
        key = self.key(*parts)
        store.set(key, self.seal(key, value))
        return key

    def get(self, store, what: str, *parts: object, schema: Schema | None = None) -> Any:
        """The verified record at ``parts``; None when absent or rejected."""
        key = self.key(*parts)
        if not store.check([key]):
            return None
        return self.open(key, store.get(key), what, schema)


@functools.lru_cache(maxsize=8)
def of(token: str) -> Auth:
    return Auth(token)
