"""The host-ring restore bench (issue 37, bench/tpu/restore-ring) on CPU devices, forced onto the ring:
the same code path the TPU run takes. No time is checked: the run's own checks are that every restore
is bit-exact and that a held result is unchanged after later restores reused the ring."""

from __future__ import annotations

import json

from resilax_bench import restore_ring


def test_restore_ring_bench_restores_bit_exact_and_keeps_a_held_result(tmp_path, capsys) -> None:
    out = tmp_path / "ring.json"
    rc = restore_ring.main(["--size-gib", "0.004", "--leaves", "4", "--rounds", "1", "--force-ring",
                            "--ring-bytes", str(1 << 20), "--workdir", str(tmp_path / "ckpt"), "--json", str(out)])
    assert rc == 0, capsys.readouterr().out
    got = json.loads(out.read_text())
    assert got["platform"] == "cpu" and got["bit_exact"] and got["held_result_unchanged"]
    assert len(got["restore_ring_s"]) == len(got["restore_fresh_s"]) == 1
