"""Aggregate GFLOP/s (total flops over total best times) per library, mesh shape set, warm/cold and
thread count, over the rounds given, taking each shape's faster round."""
import json, sys, collections
best = {}
for path in sys.argv[1:]:
    for line in open(path):
        r = json.loads(line)
        key = (r["library"], r["mesh"], r["cold"], r["m"], r["n"], r["k"], r["transposed_left"], r["transposed_right"])
        for t in (1, 2):
            g = r[f"gflops_{t}"]
            pct = r[f"peak_pct_{t}"]
            old = best.get(key + (t,))
            if old is None or g > old[0]:
                best[key + (t,)] = (g, g / pct * 100)
agg = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
for (lib, mesh, cold, m, n, k, ta, tb, t), (g, peak) in best.items():
    flops = 2.0 * m * n * k
    a = agg[(mesh, cold, t, lib)]
    a[0] += flops; a[1] += flops / (g * 1e9); a[2] = peak
for key in sorted(agg):
    flops, secs, peak = agg[key]
    g = flops / secs / 1e9
    mesh, cold, t, lib = key
    print(f"{mesh} {'cold' if cold else 'warm'} {t} thread(s) {lib:18s} {g:6.1f} GFLOP/s {100 * g / peak:5.1f}% of peak")
