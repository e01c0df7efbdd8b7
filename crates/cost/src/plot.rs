//! The scaling sweep as an SVG plot: parallel efficiency against device count, one line per strategy
//! and scaling, infeasible points left out.

use super::search::{Scaling, SweepPoint};
use plotters::prelude::*;

/// Efficiency (in percent) against devices for each (strategy, scaling), as an SVG document.
pub fn efficiency_svg(points: &[SweepPoint], title: &str) -> Result<String, String> {
    let mut svg = String::new();
    draw(&mut svg, points, title).map_err(|e| format!("cannot draw the plot: {e}"))?;
    Ok(svg)
}

type DrawResult = Result<(), Box<dyn std::error::Error>>;

fn draw(svg: &mut String, points: &[SweepPoint], title: &str) -> DrawResult {
    let root = SVGBackend::with_string(svg, (720, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let max_devices = points.iter().map(|p| p.devices).max().unwrap_or(256).max(4) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d((2.0f64..max_devices * 2.0).log_scale(), 0.0f64..110.0)?;
    chart
        .configure_mesh()
        .x_desc("devices")
        .y_desc("parallel efficiency (%)")
        .x_label_formatter(&|x| format!("{:.0}", x))
        .draw()?;
    let series = [
        ("optimus", Scaling::Strong, BLUE),
        ("megatron", Scaling::Strong, RED),
        ("optimus", Scaling::Weak, CYAN),
        ("megatron", Scaling::Weak, MAGENTA),
    ];
    for (strategy, scaling, color) in series {
        let line: Vec<(f64, f64)> = points
            .iter()
            .filter(|p| p.strategy == strategy && p.scaling == scaling)
            .filter_map(|p| p.efficiency.map(|e| (p.devices as f64, 100.0 * e)))
            .collect();
        let label = format!("{strategy} {}", if scaling == Scaling::Weak { "weak" } else { "strong" });
        chart
            .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
        chart.draw_series(line.into_iter().map(|xy| Circle::new(xy, 3, color.filled())))?;
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}
