//! Binds a call's positional and keyword arguments to a signature, with precise diagnostics.

use super::{Elab, Fail, R};
use crate::diag::Diagnostic;
use crate::syntax::ast::{Call, Expr};

/// A callable's parameters, in positional order; the first `required` must be given.
pub struct Signature<'s> {
    pub name: &'s str,
    pub params: &'s [&'s str],
    pub required: usize,
}

/// The argument expressions bound to each parameter of a signature.
pub struct Bound<'a> {
    pub args: Vec<Option<&'a Expr>>,
}

impl<'a> Bound<'a> {
    pub fn get(&self, index: usize) -> Option<&'a Expr> {
        self.args.get(index).copied().flatten()
    }
}

/// Formats "1 argument" / "2 arguments".
pub fn plural(n: usize, word: &str) -> String {
    if n == 1 { format!("{n} {word}") } else { format!("{n} {word}s") }
}

impl Elab<'_> {
    /// Matches a call against a signature; reports every problem with the argument list at once.
    pub fn bind<'a>(&mut self, call: &'a Call, sig: &Signature<'_>) -> R<Bound<'a>> {
        let mut bound: Vec<Option<&'a Expr>> = vec![None; sig.params.len()];
        let mut ok = true;
        let positional: Vec<_> = call.args.iter().filter(|a| a.name.is_none()).collect();
        if positional.len() > sig.params.len() {
            let extra = &positional[sig.params.len()];
            self.report(
                Diagnostic::error(
                    "E0103",
                    format!(
                        "`{}` takes at most {} but {} were given",
                        sig.name,
                        plural(sig.params.len(), "argument"),
                        positional.len()
                    ),
                )
                .primary(extra.span.to(positional[positional.len() - 1].span), "unexpected argument")
                .note(format!("`{}` takes ({})", sig.name, sig.params.join(", "))),
            );
            ok = false;
        }
        for (slot, arg) in bound.iter_mut().zip(&positional) {
            *slot = Some(&arg.value);
        }
        for arg in call.args.iter().filter(|a| a.name.is_some()) {
            let Some(name) = &arg.name else { continue };
            match sig.params.iter().position(|p| *p == name.name) {
                Some(i) if bound[i].is_some() => {
                    self.report(
                        Diagnostic::error("E0104", format!("argument `{}` is given twice", name.name))
                            .primary(arg.span, "given again here"),
                    );
                    ok = false;
                }
                Some(i) => bound[i] = Some(&arg.value),
                None => {
                    let mut d =
                        Diagnostic::error("E0104", format!("`{}` has no argument named `{}`", sig.name, name.name))
                            .primary(name.span, "unknown keyword")
                            .note(format!("`{}` takes ({})", sig.name, sig.params.join(", ")));
                    if let Some(s) = super::suggest(&name.name, sig.params.iter().copied()) {
                        d = d.help(format!("did you mean `{s}`?"));
                    }
                    self.report(d);
                    ok = false;
                }
            }
        }
        let missing: Vec<&str> = (0..sig.required).filter(|&i| bound[i].is_none()).map(|i| sig.params[i]).collect();
        if !missing.is_empty() && ok {
            let names = missing.iter().map(|m| format!("`{m}`")).collect::<Vec<_>>().join(", ");
            self.report(
                Diagnostic::error(
                    "E0103",
                    format!("`{}` is missing {}: {names}", sig.name, plural(missing.len(), "argument")),
                )
                .primary(call.span, format!("missing {names}"))
                .note(format!("`{}` takes ({})", sig.name, sig.params.join(", "))),
            );
            ok = false;
        }
        if ok { Ok(Bound { args: bound }) } else { Err(Fail::Reported) }
    }
}
