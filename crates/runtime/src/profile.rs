//! Where a run's time goes (`optimusc run --profile`): each device times every instruction of its
//! steps into a [`Profile`]; [`report`] groups the times of all devices by kernel kind and by collective
//! kind and group, with the FLOPs of products (achieved GFLOP/s against the measured peak) and the bytes
//! of collectives (GB/s), and totals per device.

use super::peak::Peak;
use optimus_plan::shapes::{AttentionLayout, QUERY_TILE, batch_matrix, numel, split_last};
use optimus_plan::{Collective, Coords, Instr, Kernel, Plan};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// How often one instruction ran, how long it took in all, and the times of its first runs.
#[derive(Clone, Debug, Default, PartialEq)]
struct Tally {
    count: u64,
    /// Time the device's own thread spent on it: for an overlapped collective, starting it and
    /// waiting for it (its exposed time).
    time: Duration,
    first: Vec<Duration>,
    /// Overlapped collectives: the part of their run that went on beside the device's other work.
    hidden: Duration,
}

/// Runs of one instruction whose times are kept one by one (for quantiles); the rest are only summed.
const KEPT_RUNS: usize = 16;

/// One device's instruction times over the profiled steps, by instruction index.
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    pub device: Coords,
    /// The pipeline stage whose program the device runs (its instruction indices are that program's).
    pub stage: Option<u64>,
    /// Steps accumulated (the warm-up step is not one of them).
    pub steps: u64,
    /// Wall time of those steps on this device, loading the inputs included.
    pub wall: Duration,
    /// Whether a first step was run and then dropped as warm-up.
    pub warm_up_excluded: bool,
    tallies: Vec<Tally>,
    /// Work outside the program's instructions, by name: a pipeline stage's messages to and from the
    /// other stages and its host copies.
    extras: BTreeMap<&'static str, (Category, Tally)>,
}

impl Profile {
    pub fn new(plan: &Plan, device: Coords) -> Profile {
        let tallies = vec![Tally::default(); plan.program.len()];
        let (steps, wall, extras) = (0, Duration::ZERO, BTreeMap::new());
        Profile { device, stage: None, steps, wall, warm_up_excluded: false, tallies, extras }
    }

    /// The profile of a device running pipeline stage `stage`'s program.
    pub fn of_stage(plan: &Plan, device: Coords, stage: u64) -> Profile {
        Profile { stage: Some(stage), ..Profile::new(plan, device) }
    }

    /// Adds one run of work `name` outside the program's instructions.
    pub fn record_extra(&mut self, name: &'static str, category: Category, elapsed: Duration) {
        let (_, tally) = self.extras.entry(name).or_insert((category, Tally::default()));
        tally.count += 1;
        tally.time += elapsed;
    }

    /// Adds one execution of instruction `index`.
    pub fn record(&mut self, index: usize, elapsed: Duration) {
        if let Some(tally) = self.tallies.get_mut(index) {
            tally.count += 1;
            tally.time += elapsed;
            if tally.first.len() < KEPT_RUNS {
                tally.first.push(elapsed);
            }
        }
    }

    /// Adds the wait for overlapped collective `index` (started and recorded earlier in the step): the
    /// time the device's thread was `blocked` waiting, and the `hidden` rest of its run.
    pub fn record_wait(&mut self, index: usize, blocked: Duration, hidden: Duration) {
        if let Some(tally) = self.tallies.get_mut(index) {
            tally.time += blocked;
            tally.hidden += hidden;
        }
    }

    /// The median of instruction `index`'s times over its first runs (up to 16), which a few slow
    /// runs (another process taking the core) do not move as they move the mean.
    pub fn median(&self, index: usize) -> Option<Duration> {
        let mut times = self.tallies.get(index)?.first.clone();
        times.sort();
        times.get(times.len() / 2).copied()
    }

    /// Closes a step that took `wall` on this device; a warm-up step is dropped with all it recorded.
    pub fn finish_step(&mut self, wall: Duration, warm_up: bool) {
        if warm_up {
            self.tallies.fill(Tally::default());
            self.extras.clear();
            self.steps = 0;
            self.wall = Duration::ZERO;
            self.warm_up_excluded = true;
        } else {
            self.steps += 1;
            self.wall += wall;
        }
    }
}

/// Whether a row's time is spent computing or communicating.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Category {
    Compute,
    Communication,
    /// Copies between a device's storage and host memory that a pipeline stage makes around its passes
    /// (counted in a device's other time).
    Host,
}

/// The row an instruction counts in, and what one execution of it does.
#[derive(Clone, Debug, PartialEq)]
pub struct InstrKind {
    /// The kernel's kind (`MatMul`) or the collective's kind and group (`all_reduce (row)`).
    pub name: String,
    pub category: Category,
    /// FLOPs of one execution, for products.
    pub flops: Option<u64>,
    /// Bytes of one execution (the larger of its send and receive buffers), for collectives.
    pub bytes: Option<u64>,
}

/// The row of an instruction; `None` for a `Free`, which is left out of the table.
pub fn instruction_kind(plan: &Plan, instr: &Instr) -> Option<InstrKind> {
    match instr {
        Instr::Kernel { kernel, inputs, output, .. } => {
            let shapes: Vec<&[u64]> = inputs.iter().map(|&b| plan.buffer(b).shape.as_slice()).collect();
            Some(InstrKind {
                name: kernel.name().to_string(),
                category: Category::Compute,
                flops: product_flops(kernel, &shapes, &plan.buffer(*output).shape),
                bytes: None,
            })
        }
        Instr::Collective { collective, .. } => Some(InstrKind {
            name: collective_name(collective),
            category: Category::Communication,
            flops: None,
            bytes: Some(collective_bytes(plan, collective)),
        }),
        Instr::Free { .. } | Instr::Wait { .. } => None,
    }
}

/// `all_reduce (row)`, `broadcast (column)`, ...
pub fn collective_name(c: &Collective) -> String {
    format!("{} ({})", c.kind.name(), c.group.name())
}

/// The bytes a collective moves per member: the larger of its send and receive buffers.
fn collective_bytes(plan: &Plan, c: &Collective) -> u64 {
    plan.buffer(c.send).bytes().max(plan.buffer(c.recv).bytes())
}

/// FLOPs of one execution of a product kernel (2 per multiply-add), from its input and output shapes as
/// the kernel reads them; `None` for kernels that are not products, 0 for shapes it would refuse.
///
/// Attention counts the products the CPU kernels run: query tiles of [`QUERY_TILE`] rows, each against
/// the keys it can see, so a causal attention counts about half of the full [sq, sk] products. An
/// attention over a key/value cache ([`Kernel::CachedAttention`]) counts nothing: its work depends on
/// the step's position, which the shapes do not say.
pub fn product_flops(kernel: &Kernel, inputs: &[&[u64]], output: &[u64]) -> Option<u64> {
    match kernel {
        Kernel::MatMul { transpose_a, .. } => Some(matmul_flops(inputs, output, *transpose_a)),
        Kernel::BatchedMatMul => Some(batched_matmul_flops(inputs, output)),
        Kernel::Attention { heads, kv_heads, fused, causal } => {
            Some(2 * attention_product_flops(inputs, (*heads, *kv_heads), *fused, *causal))
        }
        Kernel::AttentionGrad { heads, kv_heads, fused, wrt, causal } => {
            let operands = inputs.get(1..).unwrap_or_default();
            let per_product = attention_product_flops(operands, (*heads, *kv_heads), *fused, *causal);
            Some(attention_grad_products(*fused, *wrt) * per_product)
        }
        _ => None,
    }
}

/// out [m, n] = op(A) op(B) with A's leading dimensions flattened; k is A's columns, or its rows when
/// A is transposed.
fn matmul_flops(inputs: &[&[u64]], output: &[u64], transpose_a: bool) -> u64 {
    let Some(a) = inputs.first() else { return 0 };
    let (m, k, n) = matmul_dims(a, output, transpose_a);
    2 * mul(&[m, n, k])
}

/// (m, k, n) of out [m, n] = op(A) [m, k] op(B) [k, n], from A's shape and the output's.
fn matmul_dims(a: &[u64], output: &[u64], transpose_a: bool) -> (usize, usize, usize) {
    let (a_rows, a_cols) = split_last(a);
    let (m, n) = split_last(output);
    (m, if transpose_a { a_rows } else { a_cols }, n)
}

/// [.., m, k] x [.., k, n] -> [.., m, n] for every leading index.
fn batched_matmul_flops(inputs: &[&[u64]], output: &[u64]) -> u64 {
    let (Some(a), Ok((lead, m, n))) = (inputs.first(), batch_matrix(output, "the output")) else { return 0 };
    let Ok((_, _, k)) = batch_matrix(a, "A") else { return 0 };
    2 * mul(&[numel(lead), m, n, k])
}

/// FLOPs of one [sq, d] x [d, sk] product for every batch and head, as the tiles compute it:
/// 2 * b * h * d * (sq * sk, or for a causal attention the sum over query tiles of rows x visible keys),
/// h the query heads (each runs its own products, whichever kv head it reads).
fn attention_product_flops(operands: &[&[u64]], (heads, kv_heads): (u64, u64), fused: bool, causal: bool) -> u64 {
    let Ok(l) = AttentionLayout::new(operands, heads, kv_heads, fused) else { return 0 };
    let (sq, sk) = (l.seq(0), l.seq(1));
    let scores: usize = if causal {
        (0..sq).step_by(QUERY_TILE).map(|start| QUERY_TILE.min(sq - start) * (start + QUERY_TILE).min(sq).min(sk)).sum()
    } else {
        sq.saturating_mul(sk)
    };
    2 * mul(&[l.batch, l.heads, l.d, scores])
}

/// Products an attention gradient runs per head: the scores again (q k^T), then p^T dy for v, dy v^T
/// for q or k, and ds k for q or ds^T q for k; fused, all of them.
fn attention_grad_products(fused: bool, wrt: u8) -> u64 {
    match (fused, wrt) {
        (true, _) => 5,
        (false, 2) => 2,
        (false, _) => 3,
    }
}

fn mul(factors: &[usize]) -> u64 {
    factors.iter().fold(1u64, |p, &f| p.saturating_mul(f as u64))
}

/// The profile of a whole run: one table summed over devices, and totals per device.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProfileReport {
    pub peak_gflops: f64,
    pub peak_threads: usize,
    pub peak_isa: String,
    /// The peak measured just before the run, where it was ([`Peak::before_run_gflops`]): a machine
    /// whose speed changed during the run shows it here, against `peak_gflops` after it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_before_run_gflops: Option<f64>,
    /// What the CPU kernels multiply matrices with ("OpenBLAS (...)" or "faer").
    pub cpu_products: String,
    /// Why the machine's OpenBLAS was not used, where it was found and left aside
    /// ([`super::cpu::blas::left_aside`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_products_left_aside: Option<String>,
    /// The sequential product calls each library ran in this process (products split over the pool
    /// count once per part; attention's and the bf16 emulation's are faer's).
    pub cpu_product_calls: super::cpu::blas::Calls,
    /// Steps in the table (per device).
    pub steps_profiled: u64,
    /// Whether the first step was left out as warm-up (it is when the run has more than one).
    pub warm_up_excluded: bool,
    /// By total time, largest first.
    pub rows: Vec<ProfileRow>,
    /// The matrix products (`MatMul`) by shape and form, most time first.
    pub products: Vec<ProductShapeRow>,
    pub devices: Vec<DeviceTotals>,
}

/// The matrix products of one shape and form, summed over devices and profiled steps: the row of
/// `MatMul` broken down, as torch.profiler groups by input shape.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProductShapeRow {
    /// out [m, n] = op(A) [m, k] op(B) [k, n], a device's blocks.
    pub m: u64,
    pub k: u64,
    pub n: u64,
    /// `A B`, `A^T B`, `A B^T` or `A^T B^T`, with ` +=` where it adds into its output.
    pub form: String,
    pub count: u64,
    pub total_ms: f64,
    /// Share of all the products' time.
    pub share_pct: f64,
    pub gflops: f64,
    pub peak_pct: Option<f64>,
    /// FLOP/s of a typical call: each product instruction's median time over its first runs (up to
    /// 16), which the slow spells of a shared machine move less than they move the mean.
    pub median_gflops: f64,
    pub median_peak_pct: Option<f64>,
}

/// One kernel kind or collective kind and group, summed over devices and profiled steps.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProfileRow {
    pub name: String,
    pub category: Category,
    pub count: u64,
    pub total_ms: f64,
    /// Share of the time of all rows.
    pub share_pct: f64,
    pub avg_us: f64,
    /// Products: FLOPs in all, FLOPs per second of their own time, and that against the peak.
    pub flops: Option<u64>,
    pub gflops: Option<f64>,
    pub peak_pct: Option<f64>,
    /// Collectives: bytes in all and bytes per second of their own time.
    pub bytes: Option<u64>,
    pub gb_per_s: Option<f64>,
    /// Collectives: the time their run went on beside computation (overlapped collectives), which
    /// `total_ms` (the time the devices' threads spent on them: exposed) leaves out.
    pub hidden_ms: Option<f64>,
}

/// One device's time over the profiled steps.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DeviceTotals {
    pub device: Coords,
    /// The pipeline stage the device belongs to, in a pipelined run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage: Option<u64>,
    pub compute_ms: f64,
    /// Collectives, waiting for peers included (exposed: what the device's thread spent on them).
    pub communication_ms: f64,
    /// Communication that ran beside computation (overlapped collectives), not in `communication_ms`.
    pub hidden_communication_ms: f64,
    /// The rest of the steps' wall time: loading inputs, releasing buffers, checking the loss.
    pub other_ms: f64,
    pub wall_ms: f64,
}

/// Sums of one row while it is built.
#[derive(Clone, Copy, Debug)]
struct RowSum {
    category: Category,
    count: u64,
    time: Duration,
    hidden: Duration,
    flops: Option<u64>,
    bytes: Option<u64>,
}

/// Groups every device's profile of `plan` into one table and per-device totals.
pub fn report(plan: &Plan, profiles: &[Profile], peak: &Peak) -> ProfileReport {
    let runs: Vec<(&Plan, &Profile)> = profiles.iter().map(|p| (plan, p)).collect();
    report_of_programs(&runs, peak)
}

/// [`report`] over devices running programs of their own (a pipeline's stages): each profile with the
/// plan whose instructions it timed.
pub fn report_of_programs(runs: &[(&Plan, &Profile)], peak: &Peak) -> ProfileReport {
    let kinds: Vec<(Vec<Option<InstrKind>>, &Profile)> = runs
        .iter()
        .map(|&(plan, profile)| (plan.program.iter().map(|i| instruction_kind(plan, i)).collect(), profile))
        .collect();
    ProfileReport {
        peak_gflops: peak.gflops,
        peak_threads: peak.threads,
        peak_isa: peak.isa.clone(),
        peak_before_run_gflops: peak.before_run_gflops,
        cpu_products: super::cpu::blas::product_library(),
        cpu_products_left_aside: super::cpu::blas::left_aside().map(str::to_string),
        cpu_product_calls: super::cpu::blas::calls(),
        steps_profiled: runs.first().map_or(0, |(_, p)| p.steps),
        warm_up_excluded: runs.iter().any(|(_, p)| p.warm_up_excluded),
        rows: summed_rows(&kinds, peak.gflops),
        products: products_by_shape(runs, peak.gflops),
        devices: kinds.iter().map(|(kinds, p)| device_totals(kinds, p)).collect(),
    }
}

fn summed_rows(runs: &[(Vec<Option<InstrKind>>, &Profile)], peak_gflops: f64) -> Vec<ProfileRow> {
    let mut sums: BTreeMap<&str, RowSum> = BTreeMap::new();
    for (kinds, profile) in runs {
        for (&name, (category, tally)) in &profile.extras {
            let sum = sums.entry(name).or_insert(RowSum {
                category: *category,
                count: 0,
                time: Duration::ZERO,
                hidden: Duration::ZERO,
                flops: None,
                bytes: None,
            });
            sum.count += tally.count;
            sum.time += tally.time;
        }
        for (kind, tally) in kinds.iter().zip(&profile.tallies) {
            let Some(kind) = kind else { continue };
            let sum = sums.entry(&kind.name).or_insert(RowSum {
                category: kind.category,
                count: 0,
                time: Duration::ZERO,
                hidden: Duration::ZERO,
                flops: kind.flops.map(|_| 0),
                bytes: kind.bytes.map(|_| 0),
            });
            sum.count += tally.count;
            sum.time += tally.time;
            sum.hidden += tally.hidden;
            let add = |total: Option<u64>, each: Option<u64>| match (total, each) {
                (Some(t), Some(e)) => Some(t.saturating_add(e.saturating_mul(tally.count))),
                (total, _) => total,
            };
            sum.flops = add(sum.flops, kind.flops);
            sum.bytes = add(sum.bytes, kind.bytes);
        }
    }
    let all: Duration = sums.values().map(|s| s.time).sum();
    let mut rows: Vec<ProfileRow> = sums.into_iter().map(|(name, s)| row(name, &s, all, peak_gflops)).collect();
    rows.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms).then_with(|| a.name.cmp(&b.name)));
    rows
}

/// A product's shape and form: (m, k, n, transpose_a, transpose_b, accumulate).
type ProductShape = (u64, u64, u64, bool, bool, bool);

/// Sums of one product shape while its row is built: calls, time, FLOPs, and FLOPs and median time of
/// one call of each instruction.
#[derive(Default)]
struct ShapeSum {
    count: u64,
    time: Duration,
    flops: u64,
    typical_flops: u64,
    typical_time: Duration,
}

/// The `MatMul` instructions of every device, grouped by shape and form, most time first.
fn products_by_shape(runs: &[(&Plan, &Profile)], peak_gflops: f64) -> Vec<ProductShapeRow> {
    let mut sums: BTreeMap<ProductShape, ShapeSum> = BTreeMap::new();
    for &(plan, profile) in runs {
        for (index, (instr, tally)) in plan.program.iter().zip(&profile.tallies).enumerate() {
            let Some((shape, flops)) = product_shape(plan, instr) else { continue };
            let Some(median) = profile.median(index) else { continue };
            let sum = sums.entry(shape).or_default();
            sum.count += tally.count;
            sum.time += tally.time;
            sum.flops = sum.flops.saturating_add(flops.saturating_mul(tally.count));
            sum.typical_flops = sum.typical_flops.saturating_add(flops);
            sum.typical_time += median;
        }
    }
    let all: f64 = sums.values().map(|s| s.time.as_secs_f64()).sum();
    let rate = |flops: u64, time: Duration| {
        let seconds = time.as_secs_f64();
        if seconds > 0.0 { flops as f64 / seconds / 1e9 } else { 0.0 }
    };
    let of_peak = |gflops: f64| (peak_gflops > 0.0).then(|| 100.0 * gflops / peak_gflops);
    let mut rows: Vec<ProductShapeRow> = sums
        .into_iter()
        .map(|((m, k, n, ta, tb, accumulate), s)| {
            let (gflops, median_gflops) = (rate(s.flops, s.time), rate(s.typical_flops, s.typical_time));
            ProductShapeRow {
                m,
                k,
                n,
                form: product_form(ta, tb, accumulate),
                count: s.count,
                total_ms: s.time.as_secs_f64() * 1e3,
                share_pct: if all > 0.0 { 100.0 * s.time.as_secs_f64() / all } else { 0.0 },
                gflops,
                peak_pct: of_peak(gflops),
                median_gflops,
                median_peak_pct: of_peak(median_gflops),
            }
        })
        .collect();
    rows.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms));
    rows
}

/// The shape and form of a `MatMul` instruction, and the FLOPs of one call; `None` for any other.
fn product_shape(plan: &Plan, instr: &Instr) -> Option<(ProductShape, u64)> {
    let Instr::Kernel { kernel: Kernel::MatMul { transpose_a, transpose_b, accumulate }, inputs, output, .. } = instr
    else {
        return None;
    };
    let a = &plan.buffer(*inputs.first()?).shape;
    let (m, k, n) = matmul_dims(a, &plan.buffer(*output).shape, *transpose_a);
    let flops = 2 * mul(&[m, n, k]);
    Some(((m as u64, k as u64, n as u64, *transpose_a, *transpose_b, *accumulate), flops))
}

/// `A^T B +=` and the like.
fn product_form(transpose_a: bool, transpose_b: bool, accumulate: bool) -> String {
    let operand = |name: &str, transposed: bool| if transposed { format!("{name}^T") } else { name.to_string() };
    let adds = if accumulate { " +=" } else { "" };
    format!("{} {}{adds}", operand("A", transpose_a), operand("B", transpose_b))
}

fn row(name: &str, s: &RowSum, all: Duration, peak_gflops: f64) -> ProfileRow {
    let seconds = s.time.as_secs_f64();
    let per_second = |amount: u64| (seconds > 0.0).then(|| amount as f64 / seconds / 1e9);
    let gflops = s.flops.and_then(per_second);
    ProfileRow {
        name: name.to_string(),
        category: s.category,
        count: s.count,
        total_ms: seconds * 1e3,
        share_pct: if all.is_zero() { 0.0 } else { 100.0 * seconds / all.as_secs_f64() },
        avg_us: if s.count == 0 { 0.0 } else { seconds * 1e6 / s.count as f64 },
        flops: s.flops,
        gflops,
        peak_pct: gflops.filter(|_| peak_gflops > 0.0).map(|g| 100.0 * g / peak_gflops),
        bytes: s.bytes,
        gb_per_s: s.bytes.and_then(per_second),
        hidden_ms: (s.category == Category::Communication).then_some(s.hidden.as_secs_f64() * 1e3),
    }
}

fn device_totals(kinds: &[Option<InstrKind>], profile: &Profile) -> DeviceTotals {
    let mut spent = [Duration::ZERO; 2];
    let mut hidden = Duration::ZERO;
    let extras = profile.extras.values().map(|(category, tally)| (Some(*category), tally));
    for (category, tally) in kinds.iter().map(|k| k.as_ref().map(|k| k.category)).zip(&profile.tallies).chain(extras) {
        match category {
            Some(Category::Compute) => spent[0] += tally.time,
            Some(Category::Communication) => spent[1] += tally.time,
            Some(Category::Host) | None => {}
        }
        hidden += tally.hidden;
    }
    let other = profile.wall.saturating_sub(spent[0] + spent[1]);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    DeviceTotals {
        device: profile.device,
        stage: profile.stage,
        compute_ms: ms(spent[0]),
        communication_ms: ms(spent[1]),
        hidden_communication_ms: ms(hidden),
        other_ms: ms(other),
        wall_ms: ms(profile.wall),
    }
}

impl ProfileReport {
    /// The report as text tables: a header with the peak, the summed table, then one line per device.
    pub fn to_text(&self) -> String {
        let mut text = self.header();
        text.push_str(&self.rows_table());
        text.push('\n');
        text.push_str(&self.products_table());
        text.push_str(&self.devices_table());
        text
    }

    /// The product shapes that took the most time (all of them in the JSON record); empty without any.
    fn products_table(&self) -> String {
        if self.products.is_empty() {
            return String::new();
        }
        let shown = self.products.len().min(SHAPES_SHOWN);
        let heading = if shown < self.products.len() {
            format!(
                "products by shape, the {shown} of {} taking most time (all in the --json record):\n",
                self.products.len()
            )
        } else {
            "products by shape:\n".to_string()
        };
        let blank = || "-".to_string();
        let mut text = heading;
        text.push_str(&format!(
            "{:<22}  {:<10}  {:>7}  {:>10}  {:>7}  {:>8}  {:>6}  {:>14}  {:>13}\n",
            "m x k x n", "form", "count", "total ms", "share %", "GFLOP/s", "% peak", "median GFLOP/s", "median % peak"
        ));
        for p in &self.products[..shown] {
            text.push_str(&format!(
                "{:<22}  {:<10}  {:>7}  {:>10.2}  {:>7.1}  {:>8.1}  {:>6}  {:>14.1}  {:>13}\n",
                format!("{} x {} x {}", p.m, p.k, p.n),
                p.form,
                p.count,
                p.total_ms,
                p.share_pct,
                p.gflops,
                p.peak_pct.map_or_else(blank, |v| format!("{v:.1}")),
                p.median_gflops,
                p.median_peak_pct.map_or_else(blank, |v| format!("{v:.1}")),
            ));
        }
        text.push_str("(median: each product's median call, which slow spells of a shared machine move less)\n\n");
        text
    }

    fn header(&self) -> String {
        let plural = |n: u64, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
        let warm_up = if self.warm_up_excluded { " (step 0 left out as warm-up)" } else { "" };
        let devices = self.devices.len() as u64;
        let shared = if devices > 1 { format!("; the {devices} devices share it") } else { String::new() };
        let calls = self.cpu_product_calls;
        let products = match calls.total() {
            // No CPU kernel multiplied (a CUDA run): nothing to say about the CPU's library.
            0 => String::new(),
            all => format!(
                "CPU products: library {}; {all} product calls: {}\n{}",
                self.cpu_products,
                calls_by_library(calls),
                self.cpu_products_left_aside.as_ref().map(|why| format!("note: {why}\n")).unwrap_or_default()
            ),
        };
        let peak = match self.peak_gflops > 0.0 {
            true => format!(
                "peak {:.1} GFLOP/s measured on {} ({}){}",
                self.peak_gflops,
                plural(self.peak_threads as u64, "thread"),
                self.peak_isa,
                self.speed_during_run()
            ),
            // A GPU run: no CPU peak to measure its kernels against.
            false => "each kernel timed on the GPU, alone (no peak: % peak is left out)".to_string(),
        };
        format!(
            "profile: {}{warm_up} on {}, times summed over devices\n{peak}{shared}\n{products}\n",
            plural(self.steps_profiled, "step"),
            plural(devices, "device"),
        )
    }

    /// The peak before the run beside the one after it, and a note where they are more than
    /// [`super::peak::UNSTEADY`] apart (the machine's speed changed under the run).
    fn speed_during_run(&self) -> String {
        let Some(before) = self.peak_before_run_gflops else { return String::new() };
        let mut steadiness = super::peak::Steadiness::default();
        steadiness.add(before);
        steadiness.add(self.peak_gflops);
        let apart = 100.0 * steadiness.variation().unwrap_or(0.0);
        let note = if steadiness.is_unsteady() {
            "\nnote: this machine's speed changed during the run: its times and % peak are no closer than that"
        } else {
            ""
        };
        format!(" after the run, {before:.1} before it ({apart:.0}% apart){note}")
    }

    fn rows_table(&self) -> String {
        let width = self.rows.iter().map(|r| r.name.chars().count()).max().unwrap_or(0).max(5);
        let mut text = format!(
            "{:<width$}  {:>7}  {:>10}  {:>7}  {:>9}  {:>8}  {:>6}  {:>7}  {:>9}\n",
            "kind", "count", "total ms", "share %", "avg µs", "GFLOP/s", "% peak", "GB/s", "hidden ms"
        );
        let blank = || "-".to_string();
        for r in &self.rows {
            text.push_str(&format!(
                "{:<width$}  {:>7}  {:>10.2}  {:>7.1}  {:>9.1}  {:>8}  {:>6}  {:>7}  {:>9}\n",
                r.name,
                r.count,
                r.total_ms,
                r.share_pct,
                r.avg_us,
                r.gflops.map_or_else(blank, |g| format!("{g:.1}")),
                r.peak_pct.map_or_else(blank, |p| format!("{p:.1}")),
                r.gb_per_s.map_or_else(blank, |g| format!("{g:.3}")),
                r.hidden_ms.map_or_else(blank, |h| format!("{h:.2}")),
            ));
        }
        let count: u64 = self.rows.iter().map(|r| r.count).sum();
        let total: f64 = self.rows.iter().map(|r| r.total_ms).sum();
        text.push_str(&format!("{:<width$}  {count:>7}  {total:>10.2}  {:>7.1}\n", "total", 100.0));
        text
    }

    fn devices_table(&self) -> String {
        let mut text = format!(
            "{:<8}  {:>10}  {:>16}  {:>9}  {:>8}  {:>8}\n",
            "device", "compute ms", "communication ms", "hidden ms", "other ms", "wall ms"
        );
        for d in &self.devices {
            let device = match d.stage {
                Some(stage) => format!("s{stage} {}", d.device),
                None => d.device.to_string(),
            };
            text.push_str(&format!(
                "{:<8}  {:>10.2}  {:>16.2}  {:>9.2}  {:>8.2}  {:>8.2}\n",
                device, d.compute_ms, d.communication_ms, d.hidden_communication_ms, d.other_ms, d.wall_ms
            ));
        }
        text.push_str(
            "(a collective's total and communication ms are what the device's thread spent on it: exposed; \
             hidden ms ran beside computation, with --overlap)\n",
        );
        text
    }
}

/// Product shapes the text table shows.
const SHAPES_SHOWN: usize = 10;

/// "21504 in faer, 612 in OpenBLAS": each library that ran product calls, most calls first.
fn calls_by_library(calls: super::cpu::blas::Calls) -> String {
    let mut ran = [(calls.optimus, "our AVX2 kernel"), (calls.openblas, "OpenBLAS"), (calls.faer, "faer")];
    ran.sort_by_key(|&(count, _)| std::cmp::Reverse(count));
    let parts: Vec<String> =
        ran.iter().filter(|(count, _)| *count > 0).map(|(count, name)| format!("{count} in {name}")).collect();
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flops(kernel: Kernel, inputs: &[&[u64]], output: &[u64]) -> Option<u64> {
        product_flops(&kernel, inputs, output)
    }

    fn matmul(transpose_a: bool, transpose_b: bool) -> Kernel {
        Kernel::MatMul { transpose_a, transpose_b, accumulate: false }
    }

    fn report_with_calls(openblas: u64, faer: u64) -> ProfileReport {
        ProfileReport {
            peak_gflops: 100.0,
            peak_threads: 2,
            peak_isa: "AVX2 FMA".into(),
            peak_before_run_gflops: None,
            cpu_products: if openblas > 0 { "OpenBLAS 0.3.21".into() } else { "faer".into() },
            cpu_products_left_aside: None,
            cpu_product_calls: super::super::cpu::blas::Calls { openblas, faer, optimus: 0 },
            steps_profiled: 1,
            warm_up_excluded: false,
            rows: Vec::new(),
            products: Vec::new(),
            devices: Vec::new(),
        }
    }

    #[test]
    fn the_header_says_which_library_ran_the_cpu_products_and_nothing_when_none_ran() {
        let header = report_with_calls(3, 5).header();
        assert!(
            header.contains("CPU products: library OpenBLAS 0.3.21; 8 product calls: 5 in faer, 3 in OpenBLAS"),
            "{header}"
        );
        let mut ours = report_with_calls(0, 5);
        ours.cpu_product_calls.optimus = 12;
        ours.cpu_products = "optimus AVX2 6x16".into();
        let header = ours.header();
        assert!(
            header.contains(
                "CPU products: library optimus AVX2 6x16; 17 product calls: 12 in our AVX2 kernel, 5 in faer\n"
            ),
            "{header}"
        );
        let aside = ProfileReport {
            cpu_products_left_aside: Some("OpenBLAS 0.3.21 left aside: its Prescott kernels are narrower".into()),
            ..report_with_calls(0, 5)
        };
        assert!(
            aside.header().contains(
                "CPU products: library faer; 5 product calls: 5 in faer\n\
                 note: OpenBLAS 0.3.21 left aside: its Prescott kernels are narrower\n"
            ),
            "{}",
            aside.header()
        );
        let header = report_with_calls(0, 0).header();
        assert!(!header.contains("CPU products"), "a run with no CPU product (CUDA): {header}");
        assert!(header.ends_with(")\n\n"), "{header:?}");
    }

    fn shape_row(m: u64, total_ms: f64) -> ProductShapeRow {
        let (gflops, peak_pct) = (50.0, Some(50.0));
        let form = product_form(true, false, true);
        let (count, share_pct, median_gflops, median_peak_pct) = (2, 0.0, 60.0, Some(60.0));
        ProductShapeRow {
            m,
            k: 3,
            n: 4,
            form,
            count,
            total_ms,
            share_pct,
            gflops,
            peak_pct,
            median_gflops,
            median_peak_pct,
        }
    }

    #[test]
    fn the_products_table_shows_the_shapes_taking_most_time_and_says_how_many_it_leaves_out() {
        let none = report_with_calls(0, 0).to_text();
        assert!(!none.contains("products by shape"), "no products, no table: {none}");
        let few = ProfileReport { products: vec![shape_row(7, 2.0)], ..report_with_calls(0, 1) }.to_text();
        assert!(few.contains("products by shape:\n") && few.contains("7 x 3 x 4"), "{few}");
        assert!(few.contains("A^T B +="), "{few}");
        let rows = (0..12).map(|m| shape_row(m + 1, 12.0 - m as f64)).collect();
        let many = ProfileReport { products: rows, ..report_with_calls(0, 1) }.to_text();
        assert!(many.contains("the 10 of 12 taking most time"), "{many}");
        assert!(many.contains("10 x 3 x 4") && !many.contains("11 x 3 x 4"), "{many}");
        assert_eq!(product_form(false, true, false), "A B^T");
    }

    #[test]
    fn the_header_gives_the_peak_before_the_run_and_notes_a_change_of_speed() {
        let steady = ProfileReport { peak_before_run_gflops: Some(104.0), ..report_with_calls(0, 0) };
        let header = steady.header();
        assert!(
            header.contains(
                "peak 100.0 GFLOP/s measured on 2 threads (AVX2 FMA) after the run, 104.0 before it (4% apart)\n"
            ),
            "{header}"
        );
        assert!(!header.contains("note:"), "{header}");
        let unsteady = ProfileReport { peak_before_run_gflops: Some(140.0), ..report_with_calls(0, 0) };
        let header = unsteady.header();
        assert!(
            header.contains("140.0 before it (40% apart)\nnote: this machine's speed changed during the run"),
            "{header}"
        );
        assert!(!report_with_calls(0, 0).header().contains("before it"), "no peak measured before the run");
    }

    #[test]
    fn a_gpu_profile_names_no_cpu_peak() {
        let gpu = super::super::peak::of_backend(crate::backend::BackendKind::Cuda);
        let report = ProfileReport {
            peak_gflops: gpu.gflops,
            peak_threads: gpu.threads,
            peak_isa: gpu.isa,
            ..report_with_calls(0, 0)
        };
        let header = report.header();
        assert!(header.contains("each kernel timed on the GPU, alone") && !header.contains("GFLOP/s"), "{header}");
        let (time, flops) = (Duration::from_millis(2), Some(2_000_000_000));
        let s = RowSum { category: Category::Compute, count: 1, time, hidden: Duration::ZERO, flops, bytes: None };
        let matmul = row("MatMul", &s, time, report.peak_gflops);
        assert_eq!((matmul.gflops, matmul.peak_pct), (Some(1000.0), None), "GFLOP/s measured, no % peak");
    }

    #[test]
    fn matmul_counts_two_m_n_k_with_leading_dimensions_flattened() {
        // A [2, 3, 4] is 6 x 4; B [4, 5]; out [2, 3, 5] is 6 x 5.
        assert_eq!(flops(matmul(false, false), &[&[2, 3, 4], &[4, 5]], &[2, 3, 5]), Some(2 * 6 * 5 * 4));
        // B transposed: [5, 4] read as 4 x 5; k is still A's columns.
        assert_eq!(flops(matmul(false, true), &[&[2, 3, 4], &[5, 4]], &[2, 3, 5]), Some(2 * 6 * 5 * 4));
        // A transposed: [2, 3, 7] flattened is 6 x 7, read as 7 x 6, so k = 6 (the weight gradient x^T dy).
        assert_eq!(flops(matmul(true, false), &[&[2, 3, 7], &[2, 3, 5]], &[7, 5]), Some(2 * 7 * 5 * 6));
    }

    #[test]
    fn batched_matmul_counts_every_leading_index() {
        assert_eq!(
            flops(Kernel::BatchedMatMul, &[&[2, 3, 4, 5], &[2, 3, 5, 6]], &[2, 3, 4, 6]),
            Some(2 * 6 * 4 * 6 * 5)
        );
    }

    #[test]
    fn attention_counts_scores_and_values_over_full_matrices() {
        let (b, s, h, d) = (2u64, 8, 4, 16);
        let per_product = 2 * b * h * s * s * d;
        let fused: &[u64] = &[b, s, 3 * h * d];
        for causal in [false, true] {
            let kernel = Kernel::Attention { heads: h, kv_heads: h, causal, fused: true };
            assert_eq!(flops(kernel, &[fused], &[b, s, h * d]), Some(2 * per_product));
        }
        // Separate q, k, v with a different key length.
        let (q, kv): (&[u64], &[u64]) = (&[b, s, h * d], &[b, 2 * s, h * d]);
        let kernel = Kernel::Attention { heads: h, kv_heads: h, causal: false, fused: false };
        assert_eq!(flops(kernel, &[q, kv, kv], &[b, s, h * d]), Some(2 * 2 * per_product));
    }

    #[test]
    fn causal_attention_counts_only_the_keys_each_query_tile_sees() {
        let (b, s, h, d) = (1u64, 2 * QUERY_TILE as u64, 2, 8);
        let tile = QUERY_TILE as u64;
        // Tile 0 sees `tile` keys, tile 1 all `2 * tile`.
        let scores = tile * tile + tile * 2 * tile;
        let fused: &[u64] = &[b, s, 3 * h * d];
        let causal = Kernel::Attention { heads: h, kv_heads: h, causal: true, fused: true };
        assert_eq!(flops(causal, &[fused], &[b, s, h * d]), Some(2 * 2 * b * h * d * scores));
        let full = Kernel::Attention { heads: h, kv_heads: h, causal: false, fused: true };
        assert_eq!(flops(full, &[fused], &[b, s, h * d]), Some(2 * 2 * b * h * d * s * s));
    }

    #[test]
    fn attention_grad_counts_the_products_it_runs() {
        let (b, s, h, d) = (1u64, 4, 2, 8);
        let per_product = 2 * b * h * s * s * d;
        let dy: &[u64] = &[b, s, h * d];
        let fused = Kernel::AttentionGrad { heads: h, kv_heads: h, causal: true, fused: true, wrt: 0 };
        assert_eq!(flops(fused, &[dy, &[b, s, 3 * h * d]], &[b, s, 3 * h * d]), Some(5 * per_product));
        for (wrt, products) in [(0, 3), (1, 3), (2, 2)] {
            let kernel = Kernel::AttentionGrad { heads: h, kv_heads: h, causal: false, fused: false, wrt };
            assert_eq!(flops(kernel, &[dy, dy, dy, dy], dy), Some(products * per_product), "wrt {wrt}");
        }
    }

    #[test]
    fn other_kernels_are_not_products_and_bad_shapes_count_nothing() {
        assert_eq!(flops(Kernel::Softmax, &[&[4, 4]], &[4, 4]), None);
        assert_eq!(flops(Kernel::OptimizerStep, &[&[4], &[4], &[4], &[4]], &[4]), None);
        assert_eq!(flops(Kernel::BatchedMatMul, &[&[4]], &[4]), Some(0));
        let attention = Kernel::Attention { heads: 3, kv_heads: 3, causal: false, fused: true };
        assert_eq!(flops(attention, &[&[2, 4, 16]], &[2, 4, 16]), Some(0));
        let cached = Kernel::CachedAttention { heads: 2, kv_heads: 2, fused: false };
        assert_eq!(flops(cached, &[&[1, 1, 8], &[1, 16, 8], &[1, 16, 8], &[1]], &[1, 1, 8]), None);
    }

    #[test]
    fn kernel_names_are_variant_names() {
        assert_eq!(matmul(true, false).name(), "MatMul");
        assert_eq!(Kernel::BatchedMatMul.name(), "BatchedMatMul");
        assert_eq!(Kernel::LayerNormApply { n: 4, eps: 1e-5 }.name(), "LayerNormApply");
        assert_eq!(Kernel::LayerNormApply { n: 4, eps: 1e-5 }.flavor(), "LayerNormApply");
        assert_eq!(Kernel::Gelu { approximate: false }.flavor(), "Gelu(approximate=false)");
        let attention = Kernel::Attention { heads: 8, kv_heads: 2, causal: true, fused: false };
        assert_eq!(attention.flavor(), "Attention(causal=true, fused=false)");
        // Offsets differ between devices and are not a code path: one flavor for every device.
        let offset = optimus_plan::Offset { axis: Some(1), block: 5 };
        let lookup = Kernel::EmbeddingLookup { offset, masked: true };
        assert_eq!(lookup.flavor(), "EmbeddingLookup(masked=true)");
        let grad = Kernel::EmbeddingGrad { offset, masked: false, padding: Some(3) };
        assert_eq!(grad.flavor(), "EmbeddingGrad(masked=false)");
        for kernel in [lookup, grad, attention, Kernel::OptimizerStep, Kernel::Scale { factor: 2.0 }] {
            assert!(format!("{kernel:?}").starts_with(kernel.name()), "{kernel:?} is named {}", kernel.name());
        }
    }

    /// A device's profile of a program of `instructions`, nothing recorded yet.
    fn empty_profile(instructions: usize, stage: Option<u64>) -> Profile {
        let tallies = vec![Tally::default(); instructions];
        let (steps, wall, extras) = (0, Duration::ZERO, BTreeMap::new());
        Profile { device: Coords::default(), stage, steps, wall, warm_up_excluded: false, tallies, extras }
    }

    #[test]
    fn the_warm_up_step_is_dropped_and_shares_add_up() {
        let mut profile = empty_profile(2, None);
        profile.record(0, Duration::from_millis(50));
        profile.finish_step(Duration::from_millis(60), true);
        assert_eq!((profile.steps, profile.tallies[0].count), (0, 0));
        for _ in 0..2 {
            profile.record(0, Duration::from_millis(3));
            profile.record(1, Duration::from_millis(1));
            profile.finish_step(Duration::from_millis(5), false);
        }
        let kinds = [
            Some(InstrKind { name: "MatMul".into(), category: Category::Compute, flops: Some(4_000_000), bytes: None }),
            Some(InstrKind {
                name: "all_reduce (row)".into(),
                category: Category::Communication,
                flops: None,
                bytes: Some(1_000),
            }),
        ];
        let rows = summed_rows(&[(kinds.to_vec(), &profile), (kinds.to_vec(), &profile)], 10.0);
        assert_eq!(
            rows.iter().map(|r| (r.name.as_str(), r.count)).collect::<Vec<_>>(),
            [("MatMul", 4), ("all_reduce (row)", 4)]
        );
        assert!((rows.iter().map(|r| r.share_pct).sum::<f64>() - 100.0).abs() < 1e-9);
        assert_eq!(rows[0].flops, Some(16_000_000));
        // 16 MFLOP in 12 ms is 1.33 GFLOP/s, 13.3% of a 10 GFLOP/s peak.
        assert!((rows[0].gflops.unwrap_or_default() - 16e6 / 12e-3 / 1e9).abs() < 1e-9);
        assert!((rows[0].peak_pct.unwrap_or_default() - 100.0 * 16e6 / 12e-3 / 1e10).abs() < 1e-9);
        let totals = device_totals(&kinds, &profile);
        assert_eq!((totals.compute_ms, totals.communication_ms, totals.wall_ms), (6.0, 2.0, 10.0));
        assert!((totals.other_ms - 2.0).abs() < 1e-9);
    }

    #[test]
    fn a_stages_own_work_gets_rows_and_its_host_copies_count_as_other_time() {
        let mut profile = empty_profile(1, Some(1));
        profile.record(0, Duration::from_millis(3));
        profile.record_extra("receive (stage)", Category::Communication, Duration::from_millis(4));
        profile.record_extra("kept activations out (host)", Category::Host, Duration::from_millis(2));
        profile.record_extra("kept activations out (host)", Category::Host, Duration::from_millis(1));
        profile.finish_step(Duration::from_millis(10), false);
        let kinds =
            vec![Some(InstrKind { name: "MatMul".into(), category: Category::Compute, flops: None, bytes: None })];
        let rows = summed_rows(&[(kinds.clone(), &profile)], 10.0);
        let row = |name: &str| rows.iter().find(|r| r.name == name).map(|r| (r.count, r.total_ms, r.category));
        assert_eq!(row("receive (stage)"), Some((1, 4.0, Category::Communication)));
        assert_eq!(row("kept activations out (host)"), Some((2, 3.0, Category::Host)));
        assert_eq!(row("MatMul"), Some((1, 3.0, Category::Compute)));
        let totals = device_totals(&kinds, &profile);
        assert_eq!((totals.stage, totals.compute_ms, totals.communication_ms), (Some(1), 3.0, 4.0));
        assert!((totals.other_ms - 3.0).abs() < 1e-9, "the host copies and the rest: {}", totals.other_ms);
        let mut warm = profile.clone();
        warm.finish_step(Duration::from_millis(10), true);
        assert!(summed_rows(&[(kinds, &warm)], 10.0).iter().all(|r| r.count == 0), "the warm-up drops the extras too");
    }
}
