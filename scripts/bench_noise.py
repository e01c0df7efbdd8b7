"""How far apart repeated timings of this machine are: the benchmark scripts' common test of whether a
difference they measure is larger than the machine's own noise (a virtual machine on a busy host can
change speed by 50% for seconds at a time)."""

# Timings further apart than this are called unsteady, as optimusc's `calibrate` and `run --profile`
# call them (`peak::UNSTEADY` in crates/runtime/src/peak.rs).
UNSTEADY = 0.10


def spread(values):
    """How far the largest of `values` is above the smallest (0.38: 38%); 0 for fewer than two, or
    for values that are not all positive."""
    values = list(values)
    if len(values) < 2 or min(values) <= 0:
        return 0.0
    return max(values) / min(values) - 1.0
