//! Reports on a plan for `optimusc inspect`: memory by category, communication per collective with its
//! source line, and FLOPs.

/// Formats a byte count for people: 1.50 GiB, 12.0 MiB, 512 B.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{bytes} B") } else { format!("{value:.2} {}", UNITS[unit]) }
}
