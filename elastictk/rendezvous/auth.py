"""Who may join a job: records signed with the job-wide token (``--rdzv-token``).

Every record that can change what a node does carries an HMAC-SHA256 keyed by the token over
the job id, the run's nonce, its store key and its canonical JSON
(:mod:`elastictk.rendezvous.sealed` writes and reads them all). Binding the key means a record
cannot be replayed elsewhere (an old slot into a new round, one node's note as another's);
binding the run's nonce (a random value the first node of a run stores, sealed, in the job's
``auth`` key) means nothing captured from an earlier run with the same id and token is
believed in a later one. A node that does not know the token can still write bytes into a
shared store, but nothing it writes is believed: it reads as absent. Without a token nothing
is signed and nothing is checked, as in torchrun.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
from typing import Any

from .errors import RendezvousAuthError

MAC_FIELD = "mac"
ALG = "hmac-sha256"
CONTEXT = b"elastictk-seal/1"  # the MAC's domain: bumped if what it covers ever changes
MAC_HEX = 64  # hex digits of HMAC-SHA256: a MAC of any other length is no MAC

# The MAC member as it appears in a sealed record's bytes (keys sorted, no spaces).
_MAC_MEMBER = re.compile(rb'"mac":"([0-9a-f]{%d})"' % MAC_HEX)
_MAX_CANDIDATES = 4  # a record of the job's has one such member at its top level


def canonical(body: dict[str, Any]) -> bytes:
    """The bytes a MAC covers: the record without its MAC, keys sorted, no spaces."""
    return json.dumps({k: v for k, v in body.items() if k != MAC_FIELD},
                      separators=(",", ":"), sort_keys=True).encode()


class Signer:
    """Signs and checks records for one run of one job; ``Signer(None)`` signs nothing and
    accepts all. ``job_id`` and ``run`` (the run's nonce) are covered by every MAC."""

    def __init__(self, token: str | None, job_id: str = "", run: str = "") -> None:
        self._token = token or None
        self._key = token.encode() if token else None
        self.job_id = job_id
        self.run = run

    def for_run(self, run: str) -> "Signer":
        """The same token and job, for the run whose nonce is ``run``."""
        return Signer(self._token, self.job_id, run)

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def mac(self, key: str, body: dict[str, Any]) -> str:
        assert self._key is not None
        msg = b"\n".join((CONTEXT, self.job_id.encode(), self.run.encode(), key.encode(), canonical(body)))
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()

    def seal(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with its MAC for store key ``key`` (unchanged without a token)."""
        return dict(body, **{MAC_FIELD: self.mac(key, body)}) if self._key else dict(body)

    def verify(self, key: str, body: dict[str, Any]) -> bool:
        """Whether the parsed record ``body`` carries this run's MAC for ``key`` (all of its
        64 digits: a prefix, an empty or a longer MAC is refused)."""
        if self._key is None:
            return True
        got = body.get(MAC_FIELD)
        return (isinstance(got, str) and len(got) == MAC_HEX and got.isascii()
                and hmac.compare_digest(got, self.mac(key, body)))

    def verify_raw(self, key: str, raw: bytes) -> bool:
        """Whether the bytes ``raw`` are a record sealed for ``key``, checked before any parser
        sees them: the canonical JSON the MAC covers is ``raw`` without its ``"mac":"<hex>"``
        member (and the comma beside it), since a sealed record is that same JSON with the
        member put in its sorted place. A hostile value (nested, huge, garbled) fails here,
        unparsed. The parsed record must still pass :meth:`verify`."""
        if self._key is None:
            return True
        head = b"\n".join((CONTEXT, self.job_id.encode(), self.run.encode(), key.encode()))
        for i, m in enumerate(_MAC_MEMBER.finditer(raw)):
            if i == _MAX_CANDIDATES:
                break
            start, end = m.span()
            before, after = raw[start - 1:start], raw[end:end + 1]
            if before == b"," and after in (b",", b"}"):
                canonical_raw = raw[:start - 1] + raw[end:]
            elif before == b"{" and after == b",":
                canonical_raw = raw[:start] + raw[end + 1:]
            elif before == b"{" and after == b"}":
                canonical_raw = raw[:start] + raw[end:]
            else:
                continue
            want = hmac.new(self._key, head + b"\n" + canonical_raw, hashlib.sha256).hexdigest()
            if hmac.compare_digest(m.group(1), want.encode()):
                return True
        return False

    def check_raw(self, key: str, raw: bytes) -> bytes:
        """``raw`` if :meth:`verify_raw` holds, else :class:`RendezvousAuthError` naming the key."""
        if not self.verify_raw(key, raw):
            raise self._refused(key)
        return raw

    def check(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` if its MAC is right, else :class:`RendezvousAuthError` naming the key."""
        if not self.verify(key, body):
            raise self._refused(key)
        return body

    @staticmethod
    def _refused(key: str) -> RendezvousAuthError:
        return RendezvousAuthError(
            f"store key {key!r} is not signed with this node's rendezvous token for this run "
            "(forged, replayed from another run, garbled, or written by a node with another "
            "--rdzv-token): give every node the job's token (ELASTICTK_RDZV_TOKEN) or use a "
            "fresh --rdzv-id"
        )

    def admit(self, key: str, stamp: dict[str, Any], job_id: str, node_id: str) -> None:
        """Raise :class:`RendezvousAuthError` unless this node may join the job stamped so."""
        theirs = stamp.get("auth")
        if theirs == "none" and self._key is None:
            return
        if theirs == ALG and self._key is not None and self.verify(key, stamp):
            return
        if theirs == "none":
            why = "the job runs without a token but this node has one: drop --rdzv-token"
        elif self._key is None:
            why = "the job requires a token: set ELASTICTK_RDZV_TOKEN (or --rdzv-token) to it"
        else:
            why = "this node's --rdzv-token is not the job's: set ELASTICTK_RDZV_TOKEN to the job's token"
        raise RendezvousAuthError(f"node {node_id} refused by job {job_id!r} (store key {key!r}): {why}")
