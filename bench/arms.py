"""The decode graph replays of a log of bench/engine.py runs in arms (bench/gpu_arms.sh, bench/gpu_ab.sh), one
table per expert storage: each arm's fastest round per batch size and its ratio to the first arm; with
--logits DIR, each arm's saved decode logits (DIR/logits_<arm>.pt) against the first arm's.

    python3 bench/arms.py /tmp/k3out/arms.txt --logits /tmp/k3out [--same]

A run is a line `== arm NAME ...` (`experts X` in it names the storage), then bench/engine.py's output, whose
`... device ms per step: B1 1.750, B2 2.027, ...` line has the replays. Exit 1 if an arm has no replays, or with
--same if any arm's logits are not bit-equal to the first arm's.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path


def replays(lines: list[str]) -> dict[str, dict[str, dict[int, float]]]:
    """{storage: {arm: {batch: the fastest ms}}}, arms in order of first appearance (storage "" if unnamed)."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    arm = None
    for line in lines:
        m = re.match(r"== arm ([\w.-]+)", line)
        if m:
            e = re.search(r"experts (\S+?),? ", line + " ")
            arm = (e.group(1) if e else "", m.group(1))
            out.setdefault(arm[0], {}).setdefault(arm[1], {})
        elif arm and "device ms per step:" in line:
            best = out[arm[0]][arm[1]]
            for b, ms in re.findall(r"B(\d+) ([0-9.]+)", line.split("device ms per step:")[1]):
                best[int(b)] = min(best.get(int(b), float("inf")), float(ms))
    return out


def table(storage: str, arms: dict[str, dict[int, float]]) -> list[str]:
    first = next(iter(arms))
    batches = sorted({b for t in arms.values() for b in t})
    rows = [f"replays{', experts ' + storage if storage else ''} (ms, each arm's fastest round; / {first})",
            "arm         " + "".join(f"{'B' + str(b):>15}" for b in batches)]
    for name, t in arms.items():
        cells = []
        for b in batches:
            if b not in t:
                cells.append(f"{'-':>15}")
            elif name == first or b not in arms[first]:
                cells.append(f"{t[b]:>15.3f}")
            else:
                cells.append(f"{t[b]:>9.3f} {t[b] / arms[first][b]:.3f}")
        rows.append(f"{name:<12}" + "".join(cells))
    return rows


def logits(directory: Path, names: list[str]) -> tuple[list[str], bool]:
    """Each arm's logits against the first's: lines, and whether every one is bit-equal."""
    import torch

    base_path = directory / f"logits_{names[0]}.pt"
    if not base_path.exists():
        return [f"decode logits: {base_path} missing"], False
    base, rows, same = torch.load(base_path), [], True
    for name in names[1:]:
        path = directory / f"logits_{name}.pt"
        if not path.exists():
            rows.append(f"decode logits {name}: missing")
            same = False
            continue
        x = torch.load(path)
        diff = {b: (x[b].float() - base[b].float()).abs().max().item() for b in sorted(base.keys() & x.keys())}
        equal = base.keys() == x.keys() and all(torch.equal(base[b], x[b]) for b in base)
        same &= equal
        rows.append(f"decode logits {name} / {names[0]}: " + ("bit-equal" if equal else ", ".join(
            f"B{b} {d:.2e}" for b, d in diff.items()) + (" (batch sizes differ)" if base.keys() != x.keys() else "")))
    return rows, same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--logits", metavar="DIR", type=Path, help="compare DIR/logits_<arm>.pt with the first arm's")
    ap.add_argument("--same", action="store_true", help="exit 1 unless every arm's logits are bit-equal")
    a = ap.parse_args()
    found, ok = replays(Path(a.log).read_text().splitlines()), True
    for storage, arms in found.items():
        print("\n".join(table(storage, arms)))
        for name, t in arms.items():
            if not t:
                print(f"arm {name}: no decode graph replays in the log")
                ok = False
    if a.logits is not None:
        names = list(dict.fromkeys(n for arms in found.values() for n in arms))
        lines, same = logits(a.logits, names) if names else (["decode logits: no arms"], False)
        print("\n".join(lines))
        ok &= same or not a.same
    return 0 if ok and found else 1


if __name__ == "__main__":
    sys.exit(main())
