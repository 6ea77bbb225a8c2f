"""An Offload that races a Drop of its tenant, in process (a real
``SealedCache`` over a real ``CpuBackend`` and real AES-GCM), with the race
forced at the exact point: the drop destroys the tenant's keys after the
offload drew its key epoch and before it finished sealing. The documented
outcome (docs/engine-contract.md): ``ABORTED`` / ``TENANT_DROPPED``, nothing
stored, the victims back, and a retry stores under the tenant's fresh keys."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvseal.server.errors import TenantDropped
from kvseal.server.index import State
from kvseal.v1 import kvseal_pb2 as pb

from .test_store_drop import A, Rig, _chain


def test_offload_racing_a_drop_of_its_tenant_is_aborted_and_stores_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = Rig(tmp_path)
    try:
        hashes = _chain(2, "a")
        real = rig.sealer.begin_seal
        raced: list[bool] = []

        def begin_then_drop(*args: Any, **kwargs: Any) -> Any:
            stream = real(*args, **kwargs)  # the key epoch is drawn
            if not raced:
                raced.append(True)
                t = threading.Thread(
                    target=rig.cache.drop, args=(rig.pool_id, A, []), kwargs={"all_of_tenant": True}
                )
                t.start()
                t.join(30)
                assert not t.is_alive(), "the drop waited for the offload it races"
            return stream

        monkeypatch.setattr(rig.sealer, "begin_seal", begin_then_drop)
        with pytest.raises(TenantDropped) as info:
            rig.offload(A, hashes)
        assert info.value.code is grpc.StatusCode.ABORTED
        assert info.value.reason == "TENANT_DROPPED"
        assert pb.ErrorReason.Value(info.value.reason) > 0  # a reason the proto names
        _, states = rig.cache.index.lookup(rig.ns, A, hashes)
        assert states == [State.ABSENT, State.ABSENT], "nothing of the raced offload is stored"
        rig.offload(A, hashes)  # the retry: sealed under the tenant's fresh keys
        _, states = rig.cache.index.lookup(rig.ns, A, hashes)
        assert states == [State.READY, State.READY]
    finally:
        rig.close()
