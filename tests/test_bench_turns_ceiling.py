"""``python -m bench.turns_ceiling`` keeps working: its smallest run (one publisher and one
consumer process, four tenants, a second per count, the turns in one stream and in two)
runs end to end, as a user runs it, on one server and on a 3-node cluster, and prints a
row per count and their ratio, with every published turn acked and removed. What the
figures are is the bench's to say, not this test's."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.benches import run_bench

SMALLEST = [
    "--seconds", "1", "--publishers", "1", "--consumers", "1", "--tenants", "4",
    "--partitions", "1,2",
]  # fmt: skip
ROW = re.compile(
    r"^\| (\d+) \((\d+) leader nodes?\) \| ([\d,]+) \| ([\d.]+) \| ([\d,]+) \| [\d.]+ \+ [\d.]+ "
    r"\| ([\d,]+) of ([\d,]+) \((\d+) left\) \|$",
    re.M,
)


def bench(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return run_bench("bench.turns_ceiling", *args, timeout=timeout)


@pytest.mark.slow
@pytest.mark.serial  # it measures: a load beside it skews its figures
def test_the_smallest_run_prints_each_count_and_their_ratio_with_every_turn_acked() -> None:
    run = bench(*SMALLEST, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    r1, r3 = run.stdout.split("\n\n")
    configurations = ((r1, "R1, default sync", 1), (r3, "R3 (3 nodes), default sync", 2))
    for table, name, most_leaders in configurations:
        head = f"{name}: 1 publisher and 1 consumer processes, 4 tenants, 1 s each"
        assert table.startswith(head), table
        rows = ROW.findall(table)
        assert [row[0] for row in rows] == ["1", "2"], table
        for count, leaders, per_s, cpu_us, core, acked, published, left in rows:
            assert 1 <= int(leaders) <= min(int(count), most_leaders), table
            assert int(per_s.replace(",", "")) > 0 and float(cpu_us) > 0, table
            assert int(core.replace(",", "")) > 0, table
            assert acked == published != "0" and left == "0", table
        assert re.search(r"^\| 2 over 1 \| [\d.]+x \| [\d.]+x \| [\d.]+x \| [\d.]+x \| \|$",
                         table, re.M), table  # fmt: skip


def test_a_count_it_cannot_run_is_refused_with_why() -> None:
    run = bench("--partitions", "1,0", timeout=60)
    assert run.returncode == 2
    assert "argument --partitions: counts of 1 to 64, not '1,0'" in run.stderr
