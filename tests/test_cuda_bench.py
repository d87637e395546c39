"""The device check's plumbing, end to end on this machine: ``python -m hpkv.bench.cuda --host``
runs every stage that needs no GPU (vLLM-exact layouts, correctness through a real server, rings
and transfer worker, bandwidth rows, the SIGKILL during a load) with the host driver."""

from __future__ import annotations

import json
import subprocess
import sys

from hpkv.protocol.errors import Status
from hpkv.testing.server import env_without_hpkv


def test_the_device_check_runs_end_to_end_in_host_mode(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "hpkv.bench.cuda", "--host", "--out", str(out), "--repeat", "2"],
        env=env_without_hpkv(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "host"
    assert summary["probe"]["driver_unavailable"]  # this machine has no driver, and says so
    for name in ("LBNHC", "BLNHC"):
        res = summary["layouts"][name]
        assert res["layout"]["name"] == name
        assert res["layout"]["block_is_one_run"] == (name == "BLNHC")
        assert res["correctness"]["exact"], res["correctness"]
        assert [r["blocks"] for r in res["bandwidth"]] == [1, 16]
        assert res["fault"]["statuses"] == [Status.WORKER_DIED], res["fault"]
        assert res["fault"]["failed_within_s"] < 5
    assert summary["verdict"] == {
        "LBNHC_exact": True,
        "BLNHC_exact": True,
        "LBNHC_fault_ok": True,
        "BLNHC_fault_ok": True,
    }
