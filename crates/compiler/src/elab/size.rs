//! Tensor size limits: every tensor must fit what later stages can address, reported at the sizes behind it.

use super::{Elab, R};
use crate::diag::{Code, Diagnostic};
use crate::ir::{ConfigValue, DType, Dim, TensorType};
use optimus_plan::span::Span;
use optimus_plan::text::group_digits;

/// Most elements one tensor may hold: the most a plan may address in one buffer (the plan verifier's limit).
pub const MAX_TENSOR_ELEMENTS: u64 = 1 << 40;

/// Most elements a tensor of `dtype` may hold: [`MAX_TENSOR_ELEMENTS`], and its bytes must also fit in one
/// allocation (`isize::MAX` bytes), which matters only where `usize` is narrower than 64 bits.
pub fn max_elements(dtype: DType) -> u64 {
    let addressable_bytes = u64::try_from(isize::MAX).unwrap_or(u64::MAX);
    MAX_TENSOR_ELEMENTS.min(addressable_bytes / dtype.bytes())
}

/// The element count of `ty` if it is within [`max_elements`]; `None` if it is larger or overflows.
pub fn fitting_elements(ty: &TensorType) -> Option<u64> {
    ty.elements().filter(|&n| n <= max_elements(ty.dtype))
}

/// One dimension as written: its config name, its factors in parentheses, or its size.
fn dim_term(dim: &Dim) -> String {
    if let Some(label) = &dim.label {
        return label.clone();
    }
    if dim.factors.len() > 1 {
        let factors: Vec<String> =
            dim.factors.iter().map(|f| f.label.clone().unwrap_or_else(|| group_digits(u128::from(f.size)))).collect();
        return format!("({})", factors.join(" × "));
    }
    group_digits(u128::from(dim.size))
}

/// "vocab × hidden = 1,099,511,627,776 × 768 = 844,424,930,131,968 elements": the product as written, in
/// numbers, and its value (or that it overflows 64 bits).
pub fn product_text(ty: &TensorType) -> String {
    let terms: Vec<String> = ty.shape.iter().map(dim_term).collect();
    let numbers: Vec<String> = ty.shape.iter().map(|d| group_digits(u128::from(d.size))).collect();
    let total = match ty.elements() {
        Some(n) => format!("{} elements", group_digits(u128::from(n))),
        None => format!("more than {} elements (it overflows 64 bits)", group_digits(u128::from(u64::MAX))),
    };
    let (terms, numbers) = (terms.join(" × "), numbers.join(" × "));
    if terms == numbers { format!("{numbers} = {total}") } else { format!("{terms} = {numbers} = {total}") }
}

/// The note that states the limit for a tensor's element type.
pub fn limit_note(dtype: DType) -> String {
    format!(
        "one tensor may hold at most {} elements (2^40) of {} ({} bytes each): the most a plan can address",
        group_digits(u128::from(max_elements(dtype))),
        dtype.name(),
        dtype.bytes()
    )
}

impl Elab<'_> {
    /// Checks that a tensor fits [`max_elements`]; otherwise reports `what` (e.g. "parameter `wte.weight`") with
    /// the product of its sizes and the config values it was computed from.
    pub(crate) fn check_tensor_size(&mut self, what: &str, ty: &TensorType, span: Span) -> R<()> {
        if fitting_elements(ty).is_some() {
            return Ok(());
        }
        let d = too_large(what, ty, span, |name| self.config_value(name));
        self.fail(d)
    }
}

/// The error for a tensor past [`max_elements`]: `what` and the product of its sizes, labelled at `span`
/// and at each config value (found by `config`) its sizes were written as.
pub fn too_large<'c>(
    what: &str,
    ty: &TensorType,
    span: Span,
    config: impl Fn(&str) -> Option<&'c ConfigValue>,
) -> Diagnostic {
    let mut d = Diagnostic::error(Code::E0202, format!("{what} is too large: {}", product_text(ty)))
        .primary(span, format!("this is {}", super::ops::show_type(ty)));
    for name in config_labels(ty) {
        if let Some(c) = config(&name) {
            let how = if c.overridden { format!("set to {} by `--set`", c.value) } else { format!("{}", c.value) };
            d = d.secondary(c.span, format!("`{}` is {how}", c.name));
        }
    }
    d.note(limit_note(ty.dtype)).help("use smaller sizes, or fewer of them in one tensor")
}

/// The config names a tensor's sizes were written as, each once, in order.
fn config_labels(ty: &TensorType) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    let labels = ty.shape.iter().flat_map(|d| d.label.iter().chain(d.factors.iter().filter_map(|f| f.label.as_ref())));
    for label in labels {
        if !names.contains(label) {
            names.push(label.clone());
        }
    }
    names
}
