//! CPU kernels of RMSNorm (Llama): the local sum of squares of each row, the normalisation, and the
//! backward pieces; row statistics are all-reduced between them where the last dimension is split.

use super::{args, floats, floats_mut, par, per_row, rows_of, rows_of_mut, sum_by2};
use crate::error::{KernelError, require};
use crate::view::{View, ViewMut};
use optimus_plan::shapes::{same_len, split_last};

/// 1 / sqrt(sqsum / n + eps) of each row from its all-reduced sum of squares, in f64 as LayerNorm's.
fn inverse_rms(sqsum: &[f32], n: u64, eps: f64) -> Result<Vec<f32>, KernelError> {
    require(n > 0, || KernelError::EmptyNorm)?;
    let n = n as f64;
    Ok(sqsum.iter().map(|&q| (1.0 / (f64::from(q) / n + eps).sqrt()) as f32).collect())
}

/// (x) -> [rows, 1]: the local sum of x^2 of each row.
pub(super) fn row_square_sum(inputs: &[&View], out: &mut ViewMut) -> Result<(), KernelError> {
    super::row_sum_of(inputs, out, |v| v * v)
}

/// (x, sqsum, weight) -> weight * x * r.
pub(super) fn apply(inputs: &[&View], out: &mut ViewMut, n: u64, eps: f64) -> Result<(), KernelError> {
    let [x, sqsum, weight] = args(inputs)?;
    let (rows, width) = split_last(&x.shape);
    let xv = floats(x, "x")?;
    let r = inverse_rms(per_row(sqsum, rows, 1, "the square sum")?, n, eps)?;
    let wv = per_row(weight, 1, width, "the weight")?;
    let y = floats_mut(out)?;
    same_len("the output", y.len(), xv.len())?;
    par::row_blocks(y, width, |first, y| {
        for ((yr, xr), &r) in rows_of_mut(y, width).zip(rows_of(&xv[first * width..], width)).zip(&r[first..]) {
            for ((y, &x), &w) in yr.iter_mut().zip(xr).zip(wv) {
                *y = x * r * w;
            }
        }
        Ok::<(), KernelError>(())
    })
}

/// (dy, x, weight) -> [rows, 1]: the local sum of dy * weight * x of each row.
pub(super) fn grad_sum(inputs: &[&View], out: &mut ViewMut) -> Result<(), KernelError> {
    let [dy, x, weight] = args(inputs)?;
    let (rows, width) = split_last(&x.shape);
    let (dyv, xv) = (per_row(dy, rows, width, "dy")?, floats(x, "x")?);
    let wv = per_row(weight, 1, width, "the weight")?;
    let y = floats_mut(out)?;
    same_len("the output", y.len(), rows)?;
    y.fill(0.0);
    par::costed_row_blocks(y, 1, 2 * width, |first, y| {
        let mut scaled = vec![0.0f32; width];
        let rows = rows_of(&dyv[first * width..], width).zip(rows_of(&xv[first * width..], width));
        for (y, (dyr, xr)) in y.iter_mut().zip(rows) {
            for ((s, &dy), &w) in scaled.iter_mut().zip(dyr).zip(wv) {
                *s = dy * w;
            }
            *y = sum_by2(&scaled, xr, |s, x| s * x);
        }
        Ok::<(), KernelError>(())
    })
}

/// (dy, x, weight, sqsum, gradsum) -> dx = r * weight * dy - r^3 / n * x * gradsum.
pub(super) fn grad_input(inputs: &[&View], out: &mut ViewMut, n: u64, eps: f64) -> Result<(), KernelError> {
    let [dy, x, weight, sqsum, gradsum] = args(inputs)?;
    let (rows, width) = split_last(&x.shape);
    let (dyv, xv) = (per_row(dy, rows, width, "dy")?, floats(x, "x")?);
    let wv = per_row(weight, 1, width, "the weight")?;
    let r = inverse_rms(per_row(sqsum, rows, 1, "the square sum")?, n, eps)?;
    let dots = per_row(gradsum, rows, 1, "the gradient sum")?;
    // Per row: (r, r^3 / n * gradsum), the second in f64 before rounding.
    let coefficients: Vec<(f32, f32)> = r
        .iter()
        .zip(dots)
        .map(|(&r, &d)| {
            let r64 = f64::from(r);
            (r, (r64 * r64 * r64 * f64::from(d) / n as f64) as f32)
        })
        .collect();
    let dx = floats_mut(out)?;
    same_len("the output", dx.len(), xv.len())?;
    par::row_blocks(dx, width, |first, dx| {
        let (dyv, xv) = (&dyv[first * width..], &xv[first * width..]);
        let rows_iter = rows_of_mut(dx, width).zip(rows_of(dyv, width)).zip(rows_of(xv, width));
        for (((dxr, dyr), xr), &(r, c)) in rows_iter.zip(&coefficients[first..]) {
            for (((dx, &dy), &x), &w) in dxr.iter_mut().zip(dyr).zip(xr).zip(wv) {
                *dx = r * w * dy - c * x;
            }
        }
        Ok::<(), KernelError>(())
    })
}

/// (dy, x, sqsum) -> [last]: the sum over rows of dy * x * r.
pub(super) fn grad_weight(inputs: &[&View], out: &mut ViewMut, n: u64, eps: f64) -> Result<(), KernelError> {
    let [dy, x, sqsum] = args(inputs)?;
    let (rows, width) = split_last(&x.shape);
    let (dyv, xv) = (per_row(dy, rows, width, "dy")?, floats(x, "x")?);
    let r = inverse_rms(per_row(sqsum, rows, 1, "the square sum")?, n, eps)?;
    let g = floats_mut(out)?;
    same_len("the output", g.len(), width)?;
    par::column_blocks(g, rows, |first, g| {
        g.fill(0.0);
        let columns = first..first + g.len();
        for ((dyr, xr), &r) in rows_of(dyv, width).zip(rows_of(xv, width)).zip(&r) {
            for ((g, &dy), &x) in g.iter_mut().zip(&dyr[columns.clone()]).zip(&xr[columns.clone()]) {
                *g += dy * x * r;
            }
        }
        Ok::<(), KernelError>(())
    })
}
