"""The DRA service (dra/service.py): NodePrepareResources answers our devices with our CDI id and
records them, idempotent from the record across a restart, per claim (an unhealthy device, a claim
the API cannot give, another driver's), and NodeUnprepareResources; driven by the strict kubelet
stand-in over real unix sockets where the kubelet's view matters, called directly elsewhere. (The
registration that puts it before the kubelet is test_dra_registration.py's.)"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from hyperlight_agent.device.observation import Observation
from hyperlight_agent.dra.prepared import Prepared
from hyperlight_agent.dra.service import Service
from hyperlight_agent.dra.types import AllocatedDevice, ClaimError
from standin.dra_kubelet import Claim, DraKubeletStandin
from tests.conftest import until
from tests.test_dra_registration import CDI_KVM, CLAIM, DRIVER, HEALTHY, FakeClaims, Node, ours, registered, run

# --- prepare and unprepare -------------------------------------------------------------------------


def test_prepare_answers_our_devices_with_our_cdi_id_and_records_them(tmp: str) -> None:
    async def body(node: Node, kubelet: DraKubeletStandin) -> None:
        node.claims.claims[CLAIM.uid] = [
            ours("kvm-3", share_id="s-1"),
            AllocatedDevice(request="gpu", driver="gpu.example.com", pool="p", device="gpu-0", share_id=None),
        ]
        registrar = await node.start("pod-a")
        await registered(kubelet, registrar)
        entries = await kubelet.prepare(DRIVER, [CLAIM])
        assert entries[CLAIM.uid].error == ""
        [device] = entries[CLAIM.uid].devices  # the other driver's result is not ours to answer
        assert (
            list(device.request_names),
            device.pool_name,
            device.device_name,
            list(device.cdi_device_ids),
            device.share_id,
        ) == (["hv"], "node1", "kvm-3", [CDI_KVM], "s-1")
        assert Prepared(node.data).get(CLAIM.uid) is not None
        entries = await kubelet.unprepare(DRIVER, [CLAIM])
        assert entries[CLAIM.uid].error == ""
        assert Prepared(node.data).claims() == {}

    run(tmp, body)


def test_prepare_is_idempotent_across_a_restart(tmp: str) -> None:
    async def body(node: Node, kubelet: DraKubeletStandin) -> None:
        node.claims.claims[CLAIM.uid] = [ours()]
        first = await node.start("pod-a")
        await registered(kubelet, first)
        answer = await kubelet.prepare(DRIVER, [CLAIM])
        await first.close()
        await until(lambda: DRIVER not in kubelet.instances, what="deregistration")
        # The claim is gone from the API and the device went bad meanwhile: a prepared claim
        # still gets the same answer, from the record the new service reads at start.
        del node.claims.claims[CLAIM.uid]
        node.observation = Observation(healthy=False, reason="gone", hypervisor=None)
        reads = node.claims.reads
        second = await node.start("pod-a")
        await registered(kubelet, second)
        assert await kubelet.prepare(DRIVER, [CLAIM]) == answer
        assert node.claims.reads == reads

    run(tmp, body)


def test_an_unhealthy_device_fails_the_claim_naming_the_device(tmp: str) -> None:
    async def body(node: Node, kubelet: DraKubeletStandin) -> None:
        node.claims.claims[CLAIM.uid] = [ours("kvm-3")]
        node.observation = Observation(healthy=False, reason="KVM_CREATE_VM failed: EPERM", hypervisor="kvm")
        registrar = await node.start("pod-a")
        await registered(kubelet, registrar)
        entries = await kubelet.prepare(DRIVER, [CLAIM])
        assert entries[CLAIM.uid].error == "device kvm-3 (/dev/kvm) failed its check: KVM_CREATE_VM failed: EPERM"
        assert not entries[CLAIM.uid].devices
        assert Prepared(node.data).claims() == {}  # refused claims are not recorded: asked again, checked again
        node.observation = HEALTHY
        entries = await kubelet.prepare(DRIVER, [CLAIM])
        assert entries[CLAIM.uid].error == "" and len(entries[CLAIM.uid].devices) == 1

    run(tmp, body)


def test_claim_errors_are_per_claim_and_every_claim_gets_an_entry(tmp: str) -> None:
    async def body(node: Node, kubelet: DraKubeletStandin) -> None:
        good, missing = CLAIM, Claim("ns", "c2", "uid-2")
        replaced, foreign = Claim("ns", "c3", "uid-3"), Claim("ns", "c4", "uid-4")
        node.claims.claims[good.uid] = [ours()]
        node.claims.claims[replaced.uid] = ClaimError("claim ns/c3 got replaced")
        node.claims.claims[foreign.uid] = [AllocatedDevice("r", "other.example.com", "p", "d", None)]
        registrar = await node.start("pod-a")
        await registered(kubelet, registrar)
        entries = await kubelet.prepare(DRIVER, [good, missing, replaced, foreign])
        assert {uid: entry.error for uid, entry in entries.items()} == {
            good.uid: "",
            missing.uid: "claim ns/c2 not found",
            replaced.uid: "claim ns/c3 got replaced",
            foreign.uid: f"claim ns/c4 has no device of driver {DRIVER}",
        }

    run(tmp, body)


def test_unprepare_of_an_unknown_claim_succeeds(tmp: str) -> None:
    async def body(node: Node, kubelet: DraKubeletStandin) -> None:
        registrar = await node.start("pod-a")
        await registered(kubelet, registrar)
        entries = await kubelet.unprepare(DRIVER, [CLAIM, CLAIM])
        assert {uid: e.error for uid, e in entries.items()} == {CLAIM.uid: ""}

    run(tmp, body)


def test_a_slow_claim_read_waits_for_no_other_claim(tmp: str) -> None:
    async def main() -> None:
        gate = asyncio.Event()
        claims = FakeClaims()
        claims.claims[CLAIM.uid] = [ours()]

        class Slow(FakeClaims):
            async def allocation(self, namespace: str, name: str, uid: str) -> list[AllocatedDevice]:
                if uid == "slow":
                    await gate.wait()
                return await claims.allocation(namespace, name, uid)

        service = Service(DRIVER, Slow(), lambda: HEALTHY, Prepared(tmp), claim_read_timeout=0.05)
        from hyperlight_agent.dra import dra_v1_pb2 as v1

        request = v1.NodePrepareResourcesRequest(
            claims=[v1.Claim(namespace="ns", name="s", uid="slow"), v1.Claim(namespace="ns", name="c1", uid=CLAIM.uid)]
        )
        response = await service.NodePrepareResources(request, None, v1)  # type: ignore[arg-type]
        assert response.claims[CLAIM.uid].error == ""
        assert response.claims["slow"].error == "claim ns/s: reading its allocation took longer than 0.05 s"

    asyncio.run(main())


# --- hostile neighbours (issue 26) -------------------------------------------------------------------


def v1_request(kind: str, *claims: Claim) -> Any:
    from hyperlight_agent.dra import dra_v1_pb2 as v1

    message = v1.NodePrepareResourcesRequest if kind == "prepare" else v1.NodeUnprepareResourcesRequest
    return message(claims=[v1.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims])


# 11: a held record lock costs one bounded wait per request, names the lock and its holder, and
# an Unprepare of a claim never prepared succeeds without it.
async def test_a_held_record_lock_costs_one_wait_per_request_and_is_named(
    tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl

    from hyperlight_agent.dra import dra_v1_pb2 as v1
    from hyperlight_agent.dra import prepared

    monkeypatch.setattr(prepared, "LOCK_TIMEOUT_S", 0.2)
    claims = FakeClaims()
    many = [Claim("ns", f"c{i}", f"uid-{i}") for i in range(10)]
    for claim in many:
        claims.claims[claim.uid] = [ours()]
    record = Prepared(tmp)
    waits_for_lock: list[int] = []
    take_lock = record._lock

    async def counted() -> int:
        waits_for_lock.append(1)
        return await take_lock()

    monkeypatch.setattr(record, "_lock", counted)
    service = Service(DRIVER, claims, lambda: HEALTHY, record)
    holder = os.open(os.path.join(tmp, prepared.LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another process mid-write, or stuck
    try:
        response = await service.NodePrepareResources(v1_request("prepare", *many), None, v1)  # type: ignore[arg-type]
        errors = {response.claims[c.uid].error for c in many}
        (error,) = errors
        assert error.startswith(f"cannot lock {tmp}/prepared.lock: held by pid {os.getpid()} "), error
        assert waits_for_lock == [1], "one wait for the lock per request, not one per claim"
        never = v1_request("unprepare", Claim("ns", "x", "never"))
        unknown = await service.NodeUnprepareResources(never, None, v1)  # type: ignore[arg-type]
        assert unknown.claims["never"].error == "" and waits_for_lock == [1]
    finally:
        os.close(holder)
    response = await service.NodePrepareResources(v1_request("prepare", *many), None, v1)  # type: ignore[arg-type]
    assert all(response.claims[c.uid].error == "" for c in many) and len(record.claims()) == 10


# 12: claim reads hanging on a slow API do not hold up work that needs no API.
async def test_hanging_claim_reads_do_not_delay_work_that_needs_no_api(tmp: str) -> None:
    from hyperlight_agent import waits
    from hyperlight_agent.dra import dra_v1_pb2 as v1

    gate = asyncio.Event()
    claims = FakeClaims()
    claims.claims[CLAIM.uid] = [ours()]

    class Hanging(FakeClaims):
        async def allocation(self, namespace: str, name: str, uid: str) -> list[AllocatedDevice]:
            if uid.startswith("hang"):
                await gate.wait()
            return await claims.allocation(namespace, name, uid)

    service = Service(DRIVER, Hanging(), lambda: HEALTHY, Prepared(tmp), max_concurrent=16)
    first = await service.NodePrepareResources(v1_request("prepare", CLAIM), None, v1)  # type: ignore[arg-type]
    assert first.claims[CLAIM.uid].error == ""
    hanging = [
        asyncio.ensure_future(
            service.NodePrepareResources(v1_request("prepare", Claim("ns", f"h{i}", f"hang-{i}")), None, v1)  # type: ignore[arg-type]
        )
        for i in range(20)
    ]
    try:
        await asyncio.sleep(0.05)  # the reads are under way (the variable here, not synchronisation)
        prepare = service.NodePrepareResources(v1_request("prepare", CLAIM), None, v1)  # type: ignore[arg-type]
        again = await waits.within(prepare, 5)
        assert again.claims[CLAIM.uid].error == "" and len(again.claims[CLAIM.uid].devices) == 1
        unprepare = service.NodeUnprepareResources(v1_request("unprepare", CLAIM), None, v1)  # type: ignore[arg-type]
        gone = await waits.within(unprepare, 5)
        assert gone.claims[CLAIM.uid].error == ""
    finally:
        gate.set()
        await asyncio.gather(*hanging)
