"""Do replicas sharing a store agree on what makes their blocks meet?

Two engines' blocks meet in the store only if both derive the same block
hashes (the prefix-hash algorithm and its seed), the same tenant digests (the
tenant key) and the same namespace (model fingerprint and block geometry). A
difference in any of them is silent: every lookup misses. So a registration
may carry a :class:`~kvseal.v1.kvseal_pb2.DeploymentIdentity` (a label naming
the model deployment, and digests of those facts, never the seed or key), and
a daemon with a store keeps, per label, the first one it met (with the
namespace) as a sealed record in the store itself: the one place every
replica, and the next daemon after a restart, can read. A later registration
of the label that differs gets one warning per difference (in its reply and
the daemon's log, once per difference per daemon); the registration succeeds.

The record is sealed under the deployment key like any block (the host sees
an object like the others, and a daemon under another key cannot read it: it
then writes its own, under its own key's names). It lives under a reserved
namespace no pool can have (pool namespaces are digests of a model
fingerprint and a geometry) and may be evicted like any block: the next
registration writes it again. First writer wins: a record is never
rewritten while it can be read, so the first replica's facts are the
reference (two first registrations at once both write it; each reads it
back, so a registration whose record was replaced before it read it back is
warned: narrowed, not closed), and an evicted or tampered
one (a miss: the store removed it) makes the next registrant the reference.
The seed's digest is of a value that may be small (``PYTHONHASHSEED`` is an
integer): it is sent only to the daemon, inside the VM, and stored only
sealed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading

from kvseal.server.store.errors import StoreError
from kvseal.server.store.fsstore import FsStore
from kvseal.server.store.keysource import wipe
from kvseal.v1 import kvseal_pb2 as pb

log = logging.getLogger("kvseal.agreement")

# The reserved scope of the records (a namespace no pool's digest can equal).
NAMESPACE = hashlib.sha256(b"kvseal/deployment-identity/v1\x00").digest()
TENANT = bytes(32)
MAX_LABEL = 256
_LOGGED_MAX = 4096  # distinct warnings logged per daemon (then only counted)

RANDOM_SEED = (
    "the engine's prefix hash uses a random per-process seed (e.g. a non-cryptographic "
    "hash without PYTHONHASHSEED): its block hashes differ in every engine process, so "
    "nothing it stores is found after an engine restart or by another replica; set "
    "PYTHONHASHSEED to one value in every replica, or use a sha256 prefix hash"
)


def _facts(ident: pb.DeploymentIdentity, namespace: bytes) -> dict[str, str]:
    return {
        "namespace": namespace.hex(),
        "hash_algorithm": ident.hash_algorithm,
        "hash_seed_check": bytes(ident.hash_seed_check).hex(),
        "tenant_key_check": bytes(ident.tenant_key_check).hex(),
    }


_WHAT = {
    "namespace": "the model fingerprint or block geometry (model name or path, revision, "
    "KV dtype, block size, layer names, KV layout, TP rank or size)",
    "hash_algorithm": "the prefix-hash algorithm",
    "hash_seed_check": "the prefix-hash seed (PYTHONHASHSEED)",
    "tenant_key_check": "the tenant-digest key (KVSEAL_TENANT_KEY_FILE; unset on one side?)",
}


class Agreement:
    """Compares registrations' identities through ``store`` (None: no store;
    then only the engine's own random-seed warning is given)."""

    def __init__(self, store: FsStore | None) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._logged: set[tuple[str, str]] = set()
        self.mismatches = 0  # warnings given (for tests and the log)

    def check(self, ident: pb.DeploymentIdentity, namespace: bytes) -> list[str]:
        """The warnings for a registration of ``namespace`` that carried
        ``ident`` (empty: nothing differs, or nothing to compare). Never
        raises for the store's sake: a store error skips the comparison."""
        label = ident.label[:MAX_LABEL]
        warnings: list[str] = []
        if ident.hash_seed_random:
            warnings.append(RANDOM_SEED)
        if self._store is not None and label:
            warnings += self._compare(label, _facts(ident, namespace))
        for w in warnings:
            self._log(label, w)
        return warnings

    def _compare(self, label: str, mine: dict[str, str]) -> list[str]:
        assert self._store is not None
        name = hashlib.sha256(label.encode()).digest()
        try:
            got = self._store.get(NAMESPACE, TENANT, name)
            if got is None:
                self._store.put(NAMESPACE, TENANT, name, json.dumps(mine).encode())
                # Read back: two first registrations at once (replicas started
                # together) both write, and the last rename is the reference.
                got = self._store.get(NAMESPACE, TENANT, name)
                if got is None:
                    return []
            try:
                ref = json.loads(bytes(got))
            finally:
                wipe(got)
        except (OSError, StoreError, ValueError) as e:  # a miss for the comparison
            log.warning("deployment identity of %r not compared: %s", label, type(e).__name__)
            return []
        return [
            f"replicas disagree on {_WHAT[k]} for {label!r}: this engine's blocks will not "
            "meet those of the first replica that registered it in this store"
            for k in _WHAT
            if isinstance(ref, dict) and ref.get(k) != mine[k]
        ]

    def _log(self, label: str, warning: str) -> None:
        with self._lock:
            self.mismatches += 1
            if (label, warning) in self._logged or len(self._logged) >= _LOGGED_MAX:
                return
            self._logged.add((label, warning))
        log.warning("registration of %r: %s", label, warning)
