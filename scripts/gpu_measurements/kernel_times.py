"""Summarises Nsight Compute's CSV of `gpu__time_duration.sum` per launch (kernel_times.sh): the last
step is the longest repeating tail of the launch sequence (the steps after the first launch the same kernels in the
same order); prints its kernels grouped by name with count, total and mean microseconds, and the step's
summed GPU time. Usage: kernel_times.py CSV"""

import collections
import csv
import json
import sys


def launches(path):
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("Metric Name") != "gpu__time_duration.sum":
                continue
            rows.append((row["Kernel Name"], float(row["Metric Value"].replace(",", ""))))
    return rows


def last_step(rows):
    names = [n for n, _ in rows]
    # The longest repeating tail: a short period can repeat by chance (the optimizer's launches in a row).
    for period in range(len(names) // 2, 0, -1):
        if names[-period:] == names[-2 * period:-period]:
            return rows[-period:]
    return rows


def main():
    rows = last_step(launches(sys.argv[1]))
    groups = collections.defaultdict(lambda: [0, 0.0])
    for name, ns in rows:
        short = name.split("(")[0][:70]
        groups[short][0] += 1
        groups[short][1] += ns / 1000.0
    total = sum(us for _, us in groups.values())
    print(f"{'kernel':70} {'count':>6} {'total us':>10} {'mean us':>9} {'share':>6}")
    for name, (count, us) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:70} {count:6d} {us:10.1f} {us / count:9.2f} {100 * us / total:5.1f}%")
    print(f"step: {len(rows)} launches, {total / 1000:.2f} ms of GPU time")
    print(json.dumps({"launches": len(rows), "gpu_ms": round(total / 1000, 3),
                      "kernels": {k: [c, round(us, 1)] for k, (c, us) in groups.items()}}))


if __name__ == "__main__":
    main()
