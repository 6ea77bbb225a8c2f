"""kvseal's SGLang linker in this process over SGLang's own CPU pools and a
real daemon (tests_sglang.linker_harness): the options and the staging
waits, without a server."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch

from tests_sglang.linker_harness import kv, make_linker, mha_pool, offload_and_wait, page_keys
from tests_vllm.daemon import Daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("daemon"), host_bytes="16MiB").start()
    yield d
    d.stop()


def _fill(pool: object, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in [*pool.k_buffer, *pool.v_buffer]:  # type: ignore[attr-defined]
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def test_deployment_label_is_an_option_and_names_the_identity(daemon: Daemon) -> None:
    """``deployment_label`` (read for the store's replica records) is a known
    option: setting it starts the linker, and it names the identity; an
    unknown key still fails the start with the list of known ones."""
    linker = make_linker(mha_pool(), daemon.socket, deployment_label="prod-eu")
    try:
        assert linker.mirror._identity.label == "prod-eu/tp0of1"
    finally:
        linker.close()
    with pytest.raises(ValueError, match=r"unknown option.*deployment_labl"):
        make_linker(mha_pool(), daemon.socket, deployment_labl="x")


def test_verified_load_behind_a_stalled_offload_gives_up_by_its_deadline(
    daemon: Daemon,
) -> None:
    """One staging block, held by an offload whose RPC hangs (the daemon is
    stopped): a verified load on the scheduler thread cannot get a block, and
    returns False (SGLang recomputes) while the offload still holds it,
    instead of waiting out the offload's RPC. Once the daemon runs again, the
    same load restores the page byte for byte."""
    src = mha_pool()
    _fill(src, 1)
    block = 2 * 2 * (16 * 2 * 8 * 2)  # layers x (K, V) x page bytes
    linker = make_linker(
        src, daemon.socket, staging_bytes=block, load_timeout_s=1.0, transfer_timeout_s=120
    )
    try:
        assert linker.slots._free == [0]  # exactly one staging block
        a, b = page_keys(1, 1), page_keys(2, 1)
        assert offload_and_wait(linker, [kv(a, [2])])
        assert daemon.proc is not None
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            assert linker.offload([kv(b, [3])])
            deadline = time.monotonic() + 60
            while linker.slots._free:  # the offload thread took the block
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert linker.load("r1", [kv(a, [5])]) is False
            # The load returned while the offload was still in flight.
            assert linker.num_completed_offloads() == 0 and not linker.slots._free
            assert linker.stats["staging_waits_expired"] == 1
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 120
        while linker.num_completed_offloads() == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        linker.pop_completed_offload()
        assert linker.load("r2", [kv(a, [5])]) is True
        for t in [*src.k_buffer, *src.v_buffer]:
            assert torch.equal(t[5 * 16 : 6 * 16], t[2 * 16 : 3 * 16])
    finally:
        linker.close()


def test_slots_take_waits_at_most_its_timeout() -> None:
    from kvseal.sglang.staging import Slots

    s = Slots(1)
    assert s.take(4) == [0]
    assert s.take(1, timeout=0.05) == []  # none free: gives up
    s.give([0])
    assert s.take(1, timeout=0.05) == [0]
    s.close()
    assert s.take(1) == []


def test_a_new_linker_learns_a_whole_prompt_at_its_first_lookup(daemon: Daemon) -> None:
    """A linker whose mirror never heard of a prompt's pages (a server
    restarted beside its daemon, a replica on a shared store) asks about all
    of them at its first lookup, in one background batch: once that batch has
    answered, the next lookup hits the whole prompt. It used to ask about the
    first unknown page only, so a restarted server learned one page per
    request."""
    from kvseal.sglang import pools

    src = mha_pool()
    _fill(src, 3)
    prompt = page_keys(7, 4)
    first = make_linker(src, daemon.socket)
    try:
        assert offload_and_wait(first, [kv(prompt, [1, 2, 3, 4])])
    finally:
        first.close()
    second = make_linker(mha_pool(), daemon.socket)
    try:
        mirror = second.tiers[pools.KV].mirror
        deadline = time.monotonic() + 60
        while not mirror.synced.is_set():  # discovery asks only a live mirror
            assert time.monotonic() < deadline, "the mirror never subscribed"
            time.sleep(0.02)
        assert second.lookup("r1", [kv(prompt)]) == []  # news to this mirror
        while mirror.discovery._asked:  # the one background batch answers
            assert time.monotonic() < deadline, "discovery never answered"
            time.sleep(0.02)
        assert second.lookup("r2", [kv(prompt)]) == [1, 2, 3, 4]
    finally:
        second.close()
