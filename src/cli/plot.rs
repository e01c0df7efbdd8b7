//! `optimusc plot`: draws the curves of a metrics log (`optimusc run --log`) as an SVG: loss against
//! step (training and validation) above throughput against step.

use super::Failure;
use optimus::io::metrics::{Metrics, read_metrics};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args, Debug, Clone)]
pub struct PlotArgs {
    /// A metrics log written by `optimusc run --log` (JSON lines). Records with a whole-number `step` and
    /// `loss`, `val_loss` or `tokens_per_s` (not below zero) are drawn, others skipped (with a note when they
    /// had something to draw); a step logged again (a resumed run) takes its latest values.
    #[arg(value_name = "FILE.jsonl")]
    pub log: PathBuf,
    /// Where to write the SVG: written whole or not at all (`/dev/stdout` for standard output).
    #[arg(short = 'o', long = "output", value_name = "FILE.svg")]
    pub output: PathBuf,
}

/// The throughput curve's color (plotters' GREEN is too light on white).
const DARK_GREEN: RGBColor = RGBColor(0, 140, 60);

/// The SVG's size in pixels.
const SIZE: (u32, u32) = (960, 800);

/// A curve: its name, color, points by step, and whether its points are marked.
struct Series<'a> {
    name: &'a str,
    color: RGBColor,
    points: &'a BTreeMap<u64, f64>,
    marked: bool,
}

/// One panel: a caption, the y axis, the y range, and its curves.
struct Panel<'a> {
    caption: &'a str,
    y_desc: &'a str,
    y_range: Range<f64>,
    /// Whether y labels abbreviate thousands (`12.5k`) instead of showing the digits the range needs.
    thousands: bool,
    series: Vec<Series<'a>>,
}

pub fn plot(args: &PlotArgs) -> ExitCode {
    match plot_log(args) {
        Ok(summary) => {
            eprintln_safe!("{summary}");
            ExitCode::SUCCESS
        }
        Err(failure) => failure.exit(),
    }
}

/// Reads the log, draws it and writes the SVG; returns a summary line.
fn plot_log(args: &PlotArgs) -> Result<String, Failure> {
    super::refuse_overwriting_input(&args.output, &args.log, "-o")?;
    super::check_output(&args.output, "-o")?;
    let metrics = read_metrics(&args.log).map_err(|e| e.to_string())?;
    if metrics.is_empty() {
        return Err(Failure::from(nothing_to_plot(&args.log, &metrics)));
    }
    note_records_left_out(&metrics);
    let title = format!("{}", args.log.display());
    let svg = curves_svg(&metrics, &title)?;
    optimus::io::output::write_file(&args.output, svg.as_bytes()).map_err(|e| e.to_string())?;
    Ok(format!(
        "wrote {}: training losses: {}, validation losses: {}, throughputs: {}",
        args.output.display(),
        metrics.loss.len(),
        metrics.val_loss.len(),
        metrics.tokens_per_s.len()
    ))
}

/// Says which records with something to plot were left out, and why.
fn note_records_left_out(metrics: &Metrics) {
    use optimus::plan::text::plural;
    if metrics.without_step > 0 {
        eprintln_safe!(
            "note: left out {} with a loss or throughput but no whole-number `step` (missing, negative or fractional)",
            plural(metrics.without_step as u64, "record")
        );
    }
    if metrics.negative_throughputs > 0 {
        eprintln_safe!("note: left out {} below zero", plural(metrics.negative_throughputs as u64, "`tokens_per_s`"));
    }
}

/// Why a log with no curve has none: no record at all, or records whose fields (named) hold no step
/// with a finite `loss`, `val_loss` or `tokens_per_s` (a field spelled otherwise, say).
fn nothing_to_plot(log: &std::path::Path, metrics: &Metrics) -> String {
    let expected = "expected lines such as {\"step\": 0, \"loss\": 4.2, \"tokens_per_s\": 900} or {\"step\": 9, \"val_loss\": 4.1}, \
                    as `optimusc run --log` writes";
    if metrics.records == 0 {
        return format!("`{}` has no record to plot: {expected}", log.display());
    }
    let fields: Vec<String> = metrics.fields.iter().take(12).map(|f| format!("`{f}`")).collect();
    let more = if metrics.fields.len() > fields.len() { ", ..." } else { "" };
    format!(
        "`{}` has {} but none with a whole-number `step` and a finite `loss`, `val_loss` or `tokens_per_s` \
         (the fields it has: {}{more}): {expected}",
        log.display(),
        optimus::plan::text::plural(metrics.records as u64, "record"),
        fields.join(", ")
    )
}

/// The two panels of `metrics` as an SVG document titled `title`.
pub fn curves_svg(metrics: &Metrics, title: &str) -> Result<String, String> {
    let mut svg = String::new();
    draw(&mut svg, metrics, title).map_err(|e| format!("cannot draw the plot: {e}"))?;
    Ok(svg)
}

type DrawResult = Result<(), Box<dyn std::error::Error>>;

fn draw(svg: &mut String, metrics: &Metrics, title: &str) -> DrawResult {
    let root = SVGBackend::with_string(svg, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 20))?;
    let (top, bottom) = root.split_vertically(SIZE.1 / 2);
    let steps = step_range(metrics);
    let loss = Panel {
        caption: "loss",
        y_desc: "loss",
        y_range: loss_range(metrics),
        thousands: false,
        series: vec![
            Series { name: "training loss", color: BLUE, points: &metrics.loss, marked: false },
            Series { name: "validation loss", color: RED, points: &metrics.val_loss, marked: true },
        ],
    };
    draw_panel(&top, &loss, steps.clone())?;
    let throughput = Panel {
        caption: "throughput",
        y_desc: "tokens/s",
        y_range: 0.0..top_of(metrics.tokens_per_s.values()),
        thousands: true,
        series: vec![Series { name: "tokens/s", color: DARK_GREEN, points: &metrics.tokens_per_s, marked: false }],
    };
    draw_panel(&bottom, &throughput, steps)?;
    root.present()?;
    Ok(())
}

/// Draws one panel: axes, each curve with points (a line, and circles when marked), and a legend
/// of the curves that have points when there can be more than one.
fn draw_panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, panel: &Panel, steps: Range<u64>) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let decimals = decimals_for(&panel.y_range);
    let y_label = |y: &f64| match panel.thousands {
        _ if y.abs() >= HUGE_LABEL => format!("{y:.2e}"),
        true => abbreviated(*y),
        false => format!("{y:.decimals$}"),
    };
    let mut chart = ChartBuilder::on(area)
        .caption(panel.caption, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(72)
        .build_cartesian_2d(steps, panel.y_range.clone())?;
    chart.configure_mesh().x_desc("step").y_desc(panel.y_desc).y_label_formatter(&y_label).draw()?;
    for series in panel.series.iter().filter(|s| !s.points.is_empty()) {
        let color = series.color;
        // A lone point is marked too: a line through it would not show.
        let marked = series.marked || series.points.len() == 1;
        let dot = if marked { 3 } else { 0 };
        let points: Vec<(u64, f64)> = series.points.iter().map(|(&step, &y)| (step, y)).collect();
        chart.draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?.label(series.name).legend(
            move |(x, y)| {
                EmptyElement::at((x, y))
                    + PathElement::new(vec![(0, 0), (16, 0)], color.stroke_width(2))
                    + Circle::new((8, 0), dot, color.filled())
            },
        );
        if marked {
            chart.draw_series(points.into_iter().map(|xy| Circle::new(xy, 3, color.filled())))?;
        }
    }
    // A legend tells curves apart; a panel of one curve has its axis say what it is.
    if panel.series.len() > 1 && panel.series.iter().any(|s| !s.points.is_empty()) {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    Ok(())
}

/// The steps of every curve, widened by one on each side (not below 0) when there is only one.
fn step_range(metrics: &Metrics) -> Range<u64> {
    let curves = [&metrics.loss, &metrics.val_loss, &metrics.tokens_per_s];
    let first = curves.iter().filter_map(|c| c.keys().next()).min().copied().unwrap_or(0);
    let last = curves.iter().filter_map(|c| c.keys().next_back()).max().copied().unwrap_or(0);
    if last > first { first..last } else { first.saturating_sub(1)..first.saturating_add(1) }
}

/// The largest magnitude an axis bound may have, so that a range and its width stay finite: the ticks of
/// an infinite range (a log with losses of 1e308 and -1e308) were never done being computed.
const AXIS_LIMIT: f64 = f64::MAX / 4.0;

/// `low..high` with both ends within [`AXIS_LIMIT`] and the end above the start.
fn finite_range(low: f64, high: f64) -> Range<f64> {
    let (low, high) = (low.clamp(-AXIS_LIMIT, AXIS_LIMIT), high.clamp(-AXIS_LIMIT, AXIS_LIMIT));
    if high > low { low..high } else { low - 0.1 * low.abs().max(1.0)..low + 0.1 * low.abs().max(1.0) }
}

/// The losses' range, with a margin of 5% of it above and below (of the value, for a single one).
fn loss_range(metrics: &Metrics) -> Range<f64> {
    let values = || metrics.loss.values().chain(metrics.val_loss.values()).copied();
    let low = values().fold(f64::INFINITY, f64::min);
    let high = values().fold(f64::NEG_INFINITY, f64::max);
    if !low.is_finite() {
        return 0.0..1.0;
    }
    // 5% of each end rather than of their difference, which overflows for bounds near f64::MAX.
    let margin = if high > low { 0.05 * high - 0.05 * low } else { 0.05 * low.abs().max(1.0) };
    finite_range(low - margin, high + margin)
}

/// 10% above the largest value (1 when there is none): throughput axes start at 0.
fn top_of<'a>(values: impl Iterator<Item = &'a f64>) -> f64 {
    let high = values.copied().fold(0.0, f64::max);
    if high > 0.0 { finite_range(0.0, 1.1 * high).end } else { 1.0 }
}

/// Axis labels at least this large are written in scientific notation (`1.00e308`), not in 300 digits.
const HUGE_LABEL: f64 = 1e9;

/// Decimals that tell apart labels about a tenth of `range` apart.
fn decimals_for(range: &Range<f64>) -> usize {
    let tick = (range.end - range.start) / 10.0;
    if tick > 0.0 && tick < 1.0 { (-tick.log10().floor()) as usize } else { 0 }
}

/// Thousands as `12.5k` or `125k`, millions as `1.2M`, smaller numbers whole or with two decimals.
fn abbreviated(y: f64) -> String {
    let a = y.abs();
    if a >= 1e6 {
        format!("{:.1}M", y / 1e6)
    } else if a >= 1e4 {
        format!("{:.0}k", y / 1e3)
    } else if a >= 1e3 {
        format!("{:.1}k", y / 1e3)
    } else if a >= 10.0 || a == 0.0 {
        format!("{y:.0}")
    } else {
        format!("{y:.2}")
    }
}
