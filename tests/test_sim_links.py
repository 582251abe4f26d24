"""Tier links under contention (sim/link_lanes): transfers on one link queue, writes hold their own
lane and delay reads of what they wrote, a pod-wide cap makes every worker's pod-tier traffic queue
on one lane; and bad input."""
import json

import pytest

from everybyte.sim.cli import main as sim_main
from everybyte.sim.link_lanes import Lane, Lanes, aggregate_lane
from everybyte.sim.worker import SimPool, SimWorker, WorkerSpec

GBPS = 1e9


def test_a_lane_serves_transfers_in_turn_and_pipelines_latency():
    lane = Lane(lambda nbytes: 1e-3 + nbytes / GBPS)          # 1 GB/s, 1 ms latency
    assert lane.reserve(0.0, 10**6) == pytest.approx(2e-3)    # alone: latency + 1 ms of bytes
    assert lane.reserve(0.0, 10**6) == pytest.approx(3e-3)    # behind it: 1 ms more, not 2
    assert lane.reserve(5.0, 10**6) == pytest.approx(5.002)   # an idle lane: no queue
    assert lane.reserve(5.0, 0, not_before=7.0) == pytest.approx(7.001)
    s = lane.stats()
    assert s["transfers"] == 4 and s["queued_s"] == pytest.approx(1e-3) and s["busy_s"] == pytest.approx(3e-3)


def test_a_pod_wide_lane_bounds_every_worker_after_its_own():
    pod = {("G3.5", "read"): aggregate_lane(GBPS)}
    a, b = (Lanes(lambda level, n: n / (10 * GBPS), None, pod) for _ in range(2))
    assert a.read("G3.5", 0.0, 10**6) == pytest.approx(1e-3)  # the pod's 1 GB/s, not the NIC's 10
    assert b.read("G3.5", 0.0, 10**6) == pytest.approx(2e-3)  # another worker queues behind it
    assert a.write("G3.5", 0.0, 10**6) is None                # writes not charged without write_seconds
    with pytest.raises(ValueError, match="positive"):
        aggregate_lane(0)


def _worker(block_bytes_per_s: float = GBPS) -> tuple[SimWorker, int]:
    pool = SimPool(64, 16, 1024)
    seconds = lambda level, nbytes: nbytes / block_bytes_per_s   # noqa: E731
    w = SimWorker(0, WorkerSpec(pool, host_tier_bytes=64 * pool.bytes_per_block), lambda clock: None,
                  seconds, write_seconds=seconds)
    return w, pool.bytes_per_block


def test_concurrent_loads_share_the_link_and_a_read_waits_for_its_write():
    w, nbytes = _worker()
    tiers, mover = w.memory.tiers, w.mover
    host = tiers.first
    tiers.put_down([b"a", b"b"], mover.store([0, 1], [b"a", b"b"]))      # offloaded at t=0
    written = 2 * nbytes / GBPS
    assert host.landed_at[b"a"] == pytest.approx(written)
    first = mover.start([b"a"], [5])
    assert first.deadline == pytest.approx(written + nbytes / GBPS)      # after the write, then its bytes
    second = mover.start([b"b"], [6])
    assert second.deadline == pytest.approx(first.deadline + nbytes / GBPS)   # queued behind the first
    w.clock.advance(second.deadline)
    assert {j.names[0] for j in mover.finished()} == {b"a", b"b"}
    stats = mover.lanes.stats()
    assert stats["G2 write"]["bytes"] == 2 * nbytes and stats["G2 read"]["transfers"] == 2
    assert stats["G2 read"]["queued_s"] > 0
    host.delete(b"a")
    assert b"a" not in host.landed_at
    tiers.put_down([b"c"], mover.store([2], [b"c"]))      # a later write forgets those that have landed
    assert list(host.landed_at) == [b"c"]


PODS = ["--hardware", "H200", "--kv-cache", "48MiB", "--workers", "2", "--route", "round-robin", "--max-gap", "5",
        "--gap-scale", "1", "--pod-flash", "--trace",
        "synthetic:sessions=4,turns=2,gap_s=2,gap_sigma=0,seed=2,system_tokens=0,first_tokens=512,append_tokens=32"]


def _run(capsys, *args) -> dict:
    assert sim_main(["run", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_pod_wide_cap_slows_the_loads_every_worker_makes_from_the_pod_tier(capsys):
    free = _run(capsys, *PODS)
    capped = _run(capsys, *PODS, "--pod-flash-bandwidth", "20MB")
    for out in (free, capped):
        assert out["summary"]["prefill_tokens"]["by_tier"].get("G3.5", 0) > 0     # moved turns load from it
    links = capped["summary"]["links"]
    assert links["G3.5 read (pod-wide)"]["transfers"] == links["G3.5 read"]["transfers"] > 0
    assert links["G3.5 write (pod-wide)"]["bytes"] == links["G3.5 write"]["bytes"] > 0
    assert "G3.5 read (pod-wide)" not in free["summary"]["links"]
    assert capped["assumptions"]["fleet"]["links"]["G3.5"]["aggregate_bytes_per_s"] == 20_000_000
    assert capped["summary"]["ttft_s"]["mean"] > free["summary"]["ttft_s"]["mean"]


@pytest.mark.parametrize("args, message", [
    (["--pod-flash-bandwidth", "1GB"], "--pod-flash-bandwidth needs the tier it caps: add --pod-flash"),
    (["--shared-storage", "--shared-storage-bandwidth", "fast"], "--shared-storage-bandwidth 'fast': cannot parse"),
    (["--pod-flash", "--pod-flash-bandwidth", "0"], "--pod-flash-bandwidth '0': size must be > 0"),
])
def test_bad_bandwidth_input_says_what_is_wrong(capsys, args, message):
    assert sim_main(["run", "--kv-cache", "16MiB", "--workers", "2", "--trace", "synthetic:sessions=1,turns=1",
                     *args]) == 2
    assert message in capsys.readouterr().err


def test_whatif_refuses_a_bad_pod_flash_bandwidth_before_running(capsys):
    assert sim_main(["whatif", "--levers", "pod_flash", "--pod-flash-bandwidth", "lots",
                     "--trace", "synthetic:sessions=2,turns=1"]) == 2
    assert "--pod-flash-bandwidth 'lots': cannot parse size" in capsys.readouterr().err
