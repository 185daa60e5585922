"""Summarise a py-spy `record -f raw` profile: samples per thread (its target), then the frames in the most
samples (inclusive).

    python bench/spy_summary.py profile-stub.txt [--top 25]
"""

from __future__ import annotations

import argparse
import collections

_THREAD_FRAMES = {"Thread._bootstrap", "Thread._bootstrap_inner", "Thread.run"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profile")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    frames, threads = collections.Counter(), collections.Counter()
    total = 0
    for line in open(args.profile):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        parts = stack.split(";")
        names = [f.split(" (")[0] for f in parts]
        threads[next((f for f in names if f not in _THREAD_FRAMES), names[0])] += int(n)  # the thread's target
        for fr in set(names) - _THREAD_FRAMES:
            frames[fr] += int(n)
    print(f"== {args.profile}: {total} samples; threads, then frames in the most samples (inclusive)")
    for name, n in threads.most_common(12):
        print(f"{100 * n / max(total, 1):5.1f}%  {name}")
    print()
    for fr, n in frames.most_common(args.top):
        print(f"{100 * n / max(total, 1):5.1f}%  {fr}")


if __name__ == "__main__":
    main()
