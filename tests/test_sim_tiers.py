"""The simulator's storage tiers below host memory (sim/storage_links): G3 local NVMe per worker at
the end of the real TierSet's spill chain, G4 shared storage every worker of the fleet holds, their
catalog figures with sources, and bad input."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from everybyte.sim.build import SimConfig, build
from everybyte.sim.cli import main as sim_main
from everybyte.sim.fleet_build import FleetConfig, build_fleet
from everybyte.sim.storage_links import LOCAL_NVME, NVME_DRIVE, SHARED_STORAGE, SHARED_STORAGE_BANDWIDTH, local_nvme

PARKING = "synthetic:sessions=12,turns=4,gap_s=2,arrival_s=0.5,seed=3,system_tokens=256,first_tokens=128,append_tokens=64"
SMALL = ["--hardware", "H200", "--kv-cache", "12MiB", "--kv-format", "nvfp4", "--trace", PARKING,
         "--max-gap", "5", "--gap-scale", "1"]
# one session of three turns, tool gaps of exactly 2 s (each parks); round-robin sends its second turn to worker 1
HANDOFF = "synthetic:sessions=1,turns=2,gap_s=2,gap_sigma=0,seed=2,system_tokens=0,first_tokens=512,append_tokens=32"
FLEET = ["--hardware", "H200", "--kv-cache", "48MiB", "--workers", "2", "--route", "round-robin", "--trace", HANDOFF,
         "--max-gap", "5", "--gap-scale", "1"]


def sim(capsys, *args) -> dict:
    assert sim_main(["run", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_blocks_that_overflow_g1_and_g2_come_back_from_local_nvme(capsys):
    g2 = sim(capsys, *SMALL, "--host-tier", "1MiB")["summary"]
    out = sim(capsys, *SMALL, "--host-tier", "1MiB", "--disk-tier")
    g3 = out["summary"]
    assert g3["requests"] == g2["requests"] > 40 and g3["unfinished_requests"] == 0
    assert "G3" not in g2["prefill_tokens"]["by_tier"]
    assert g3["prefill_tokens"]["by_tier"]["G3"] > 1000          # parked sessions spilled past the 1 MiB G2
    assert g3["prefill_tokens"]["computed"] < g2["prefill_tokens"]["computed"]
    disk = out["assumptions"]["disk_tier"]                     # the catalog's drives: 1 per H200, 3.84 TB each
    assert disk["capacity_bytes_per_worker"] == 3_840_000_000_000
    assert disk["load_bytes_per_s_per_worker"] == 14e9 and disk["latency_s"] == 60e-6
    assert disk["node"]["drive_bytes"]["source"].startswith("https://")
    assert out["assumptions"]["cost_model"]["tiers"]["G3"] == {"bytes_per_s": 14e9, "latency_s": 60e-6,
                                                             "write_bytes_per_s": 10e9}


def test_a_smaller_disk_tier_holds_less(capsys):
    big = sim(capsys, *SMALL, "--host-tier", "1MiB", "--disk-tier", "1GiB")["summary"]
    tiny = sim(capsys, *SMALL, "--host-tier", "1MiB", "--disk-tier", "2MiB")["summary"]
    assert tiny["prefill_tokens"]["by_tier"].get("G3", 0) < big["prefill_tokens"]["by_tier"]["G3"]


def test_a_second_worker_loads_the_first_workers_blocks_from_shared_storage(capsys):
    without = sim(capsys, *FLEET)["summary"]
    out = sim(capsys, *FLEET, "--shared-storage")
    g4 = out["summary"]
    w0, w1 = g4["fleet"]["workers"]
    assert w1["turns"] == 1 and without["fleet"]["workers"][1]["reused"] == 0
    # worker 1's only turn reuses the prefix worker 0 computed and parked into G4
    assert w1["reused_by_tier"].get("G4", 0) >= 1024 and w1["prefill_computed"] < 512
    assert g4["prefill_tokens"]["computed"] < without["prefill_tokens"]["computed"]
    link = out["assumptions"]["fleet"]["links"]["G4"]
    assert link["capacity_bytes"] == 10e15 and link["load_bytes_per_s_per_worker"] == 5e9
    assert link["latency_s"] == 5e-3 and "judgment" in link["catalog"]["capacity_bytes"]["source"]
    assert link["catalog"]["bandwidth_per_gpu"]["source"].startswith("https://")


@pytest.mark.parametrize("args", [[*SMALL, "--host-tier", "1MiB", "--disk-tier"], [*FLEET, "--shared-storage"]])
def test_multi_step_decode_makes_the_same_decisions_with_storage_tiers(capsys, args):
    on, off = sim(capsys, *args)["summary"], sim(capsys, *args, "--no-multi-step")["summary"]
    assert on["events"] < off["events"]
    for d in (on, off):
        for key in ("wall_s", "sim_requests_per_wall_s", "cpu_s", "events"):
            d.pop(key)
    assert on == off


def test_g3_spills_to_g4_and_the_tiers_run_without_torch():
    script = Path(__file__).with_name("sim_torch_free.py")
    done = subprocess.run([sys.executable, str(script), *FLEET, "--disk-tier", "1MiB", "--shared-storage"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch_loaded=False" in done.stderr
    by_tier = json.loads(done.stdout)["summary"]["prefill_tokens"]["by_tier"]
    assert by_tier["G3"] > 0 and by_tier["G4"] > 0       # a 1 MiB G3 spills on to G4, where worker 1 finds it


def test_g4_sits_below_g2_and_g3_in_every_workers_spill_chain():
    """As the real engine's --kv-tiers host:..,disk:..,shared:..,cold:.. orders them: G2 -> G3 -> G4 spill
    (G4 one tier all workers hold), the pod flash tier G3.5 written through."""
    fleet = build_fleet(SimConfig(kv_cache="4MiB", host_tier="1MiB", disk_tier="2MiB"),
                        FleetConfig("round-robin", 2, pod_flash="8MiB", shared_storage="64MiB"))
    sets = [w.memory.tiers for w in fleet.workers]
    assert [[t.level for t in ts.local] for ts in sets] == [["G2", "G3", "G4"]] * 2
    assert sets[0].local[2] is sets[1].local[2] and sets[0].local[1] is not sets[1].local[1]
    assert [t.level for t in sets[0].write_through] == ["G3.5"]
    assert fleet.cost.transfer_seconds("G3", 14_000_000) == pytest.approx(60e-6 + 1e-3)
    assert fleet.cost.transfer_seconds("G4", 5_000_000) == pytest.approx(5e-3 + 1e-3)


def test_every_storage_figure_has_a_source(capsys):
    figures = [*NVME_DRIVE.values(), *SHARED_STORAGE.values(), *SHARED_STORAGE_BANDWIDTH.values()]
    figures += [f for node in LOCAL_NVME.values() for f in node.values()]
    for value, source in figures:
        assert value > 0 and (source.startswith("https://") or "judgment" in source), source
    assert "judgment" in SHARED_STORAGE["capacity_bytes"][1]             # no source gives it: said so
    g = build(SimConfig(hardware="GB300-NVL72", gpus_per_worker=4, kv_cache="16MiB"))[0]
    link, nbytes = local_nvme(g)
    assert nbytes == 4 * 7_680_000_000_000 and link.bytes_per_s == 4 * 14e9
    assert sim_main(["hardware", "H200"]) == 0                          # `sim hardware` lists them too
    tiers = json.loads(capsys.readouterr().out)[0]["storage_tiers"]
    assert tiers["G3_local_nvme"]["drive"]["read_bytes_per_s"]["value"] == 14e9
    assert tiers["G4_shared_storage"]["bandwidth_per_gpu"]["source"].startswith("https://")


@pytest.mark.parametrize("args, message", [
    (["--disk-tier", "lots"], "--disk-tier 'lots': cannot parse size 'lots'"),
    (["--disk-tier", "0"], "--disk-tier '0': size must be > 0 bytes"),
    (["--hardware", "VR-NVL72", "--weights-format", "nvfp4", "--disk-tier"], "no sourced local NVMe (G3) figures: missing drives_per_gpu"),
    (["--workers", "2", "--shared-storage", "2 bananas"], "--shared-storage '2 bananas': cannot parse size"),
    (["--hardware", "VR-NVL72", "--weights-format", "nvfp4", "--workers", "2", "--shared-storage"],
     "no sourced shared storage (G4) figures: missing shared_storage_bytes_per_s"),
])
def test_bad_tier_input_says_what_is_wrong(capsys, args, message):
    assert sim_main(["run", "--kv-cache", "16MiB", "--trace", "synthetic:sessions=1,turns=1", *args]) == 2
    assert message in capsys.readouterr().err


def test_tier_events_end_in_what_the_tiers_hold_when_a_spill_is_a_put_inside_a_put():
    """The simulator's tier set spills synchronously, so a put into G2 that evicts runs a put into
    G3 inside it. Its removals must still come after its BlockStored: a batch of four into a G2 of
    two evicts two of its own blocks, the second after a nested put into G3 had finished (that
    one was reported before the batch's BlockStored, so a subscriber kept a block G2 no longer held)."""
    from everybyte.kv.events import BlockRemoved, BlockStored
    from everybyte.sim.tiers import NameTier, SyncTierSet
    g2, g3 = NameTier(2 * 100, "G2", 100), NameTier(8 * 100, "G3", 100, kind="disk")
    tiers = SyncTierSet([g2, g3])
    events = []
    tiers.on_event, tiers.block_size = events.append, 16
    names = [bytes([i]) * 16 for i in range(4)]
    tiers.put_down(names, [None] * 4)
    held = {"G2": set(), "G3": set()}
    for e in events:
        if isinstance(e, BlockStored):
            held[e.medium].update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            held[e.medium].difference_update(e.block_hashes)
    assert held == {"G2": set(g2.held), "G3": set(g3.held)}
    assert set(g2.held) == set(names[2:]) and set(g3.held) == set(names[:2])
