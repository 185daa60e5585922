"""bench/arms.py on logs of the shape bench/gpu_arms.sh and bench/gpu_ab.sh write: each arm's fastest round per
batch size and its ratio to the first arm, per expert storage; saved logits against the first arm's; the exit
status for a missing run and for --same."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "arms.py"
REPLAY = "decode graph replay at context 256 (row i: slot i + 1), device ms per step: "


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def cells(out: str, arm: str) -> list[str]:
    return next(line for line in out.splitlines() if line.startswith(arm + " ")).split()[1:]


def test_fastest_round_and_ratio_per_storage(tmp_path):
    log = tmp_path / "ab.txt"
    log.write_text("\n".join([
        "== arm a: (no env), src /x/src, experts mxfp4, round 1", REPLAY + "B1 1.900, B2 2.000",
        "== arm b: (no env), src /y/src, experts mxfp4, round 1", REPLAY + "B1 1.700, B2 2.200",
        "== arm b: (no env), src /y/src, experts mxfp4, round 2", REPLAY + "B1 1.750, B2 2.100",
        "== arm a: (no env), src /x/src, experts mxfp4, round 2", REPLAY + "B1 1.800, B2 2.050",
        "== arm a: (no env), src /x/src, experts bf16, round 1", "ITL p50 ms 2.0", REPLAY + "B1 2.000",
        "== arm b: (no env), src /y/src, experts bf16, round 1", REPLAY + "B1 2.500"]))
    r = run(str(log))
    assert r.returncode == 0, r.stderr
    mx, bf = r.stdout.split("replays, experts bf16")
    assert mx.startswith("replays, experts mxfp4"), r.stdout
    assert cells(mx, "a") == ["1.800", "2.000"], mx  # the fastest round of each batch size
    assert cells(mx, "b") == ["1.700", "0.944", "2.100", "1.050"], mx  # 1.7 / 1.8, 2.1 / 2.0
    assert cells(bf, "b") == ["2.500", "1.250"], bf


def test_logits_against_the_first_arm_and_the_exit_status(tmp_path):
    log = tmp_path / "arms.txt"
    log.write_text("\n".join([
        "== arm main: src src, experts mxfp4, round 1 (0 s)", REPLAY + "B1 1.817, B4 2.487",
        "== arm same: src /a/src, experts mxfp4, round 1 (90 s)", REPLAY + "B1 1.750, B4 2.514",
        "== arm moved: src /b/src, experts mxfp4, round 1 (120 s)", REPLAY + "B1 1.803"]))
    logits = {1: torch.randn(1, 8), 4: torch.randn(4, 8)}
    torch.save(logits, tmp_path / "logits_main.pt")
    torch.save({b: t.clone() for b, t in logits.items()}, tmp_path / "logits_same.pt")
    torch.save({1: logits[1] + 0.5, 4: logits[4]}, tmp_path / "logits_moved.pt")
    r = run(str(log), "--logits", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert cells(r.stdout, "moved") == ["1.803", "0.992", "-"], r.stdout  # no B4 run: a dash
    assert "decode logits same / main: bit-equal" in r.stdout, r.stdout
    assert "decode logits moved / main: B1 5.00e-01, B4 0.00e+00" in r.stdout, r.stdout
    assert run(str(log), "--logits", str(tmp_path), "--same").returncode == 1  # moved's B1 differs
    (tmp_path / "logits_moved.pt").unlink()
    r = run(str(log), "--logits", str(tmp_path))
    assert "decode logits moved: missing" in r.stdout, r.stdout
    log.write_text(log.read_text() + "\n== arm broken: src /c/src, experts mxfp4, round 1\nTraceback (most recent)")
    r = run(str(log))
    assert r.returncode == 1 and "arm broken: no decode graph replays in the log" in r.stdout, r.stdout
