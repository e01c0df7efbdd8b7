//! Binds a call's positional and keyword arguments to a signature, with precise diagnostics.

use super::{Elab, Fail, Frame, R, Value};
use crate::diag::{Code, Diagnostic};
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

/// Bound arguments with their values, each evaluated exactly once.
pub(crate) struct Evaluated<'a> {
    pub bound: Bound<'a>,
    pub values: Vec<Option<Value>>,
}

impl<'a> Evaluated<'a> {
    /// The expression and value of argument `index`, if it was given.
    pub fn get(&self, index: usize) -> Option<(&'a Expr, &Value)> {
        Some((self.bound.get(index)?, self.values.get(index)?.as_ref()?))
    }

    /// Argument `index`, which the signature requires (binding has already reported it if missing).
    pub fn required(&self, index: usize) -> R<(&'a Expr, &Value)> {
        self.get(index).ok_or(Fail::Reported)
    }
}

/// Formats "1 argument" / "2 arguments".
pub fn plural(n: usize, word: &str) -> String {
    optimus_plan::text::plural(n as u64, word)
}

/// Formats "1 was" / "2 were".
pub fn were(n: usize) -> String {
    if n == 1 { format!("{n} was") } else { format!("{n} were") }
}

impl Elab<'_> {
    /// Binds a call and evaluates every argument once. On a bad argument list, still evaluates the arguments
    /// so that errors inside them are reported too; evaluation goes on past a failed argument for the same reason.
    pub(crate) fn bind_eval<'a>(&mut self, call: &'a Call, sig: &Signature<'_>, frame: &mut Frame) -> R<Evaluated<'a>> {
        let bound = match self.bind(call, sig) {
            Ok(b) => b,
            Err(f) => return self.check_args(call, frame).and(Err(f)),
        };
        let mut values = Vec::with_capacity(bound.args.len());
        let mut failed = None;
        for expr in &bound.args {
            let value = match expr.map(|e| self.eval(e, frame)) {
                None => None,
                Some(Ok(Value::Poison)) => {
                    failed = Some(Fail::Reported);
                    None
                }
                Some(Ok(v)) => Some(v),
                Some(Err(Fail::Abort)) => return Err(Fail::Abort),
                Some(Err(f)) => {
                    failed = Some(f);
                    None
                }
            };
            values.push(value);
        }
        match failed {
            Some(f) => Err(f),
            None => Ok(Evaluated { bound, values }),
        }
    }

    /// Evaluates a call's arguments only to report the errors inside them, when the call itself cannot be
    /// made (a bad argument list, a layer whose declaration failed). Fails only if a limit was hit.
    pub(crate) fn check_args(&mut self, call: &Call, frame: &mut Frame) -> R<()> {
        for arg in &call.args {
            if matches!(self.eval(&arg.value, frame), Err(Fail::Abort)) {
                return Err(Fail::Abort);
            }
        }
        Ok(())
    }

    /// Matches a call against a signature; reports every problem with the argument list at once.
    pub fn bind<'a>(&mut self, call: &'a Call, sig: &Signature<'_>) -> R<Bound<'a>> {
        let mut bound: Vec<Option<&'a Expr>> = vec![None; sig.params.len()];
        let mut ok = true;
        let positional: Vec<_> = call.args.iter().filter(|a| a.name.is_none()).collect();
        if positional.len() > sig.params.len() {
            let extra = &positional[sig.params.len()];
            self.report(
                Diagnostic::error(
                    Code::E0103,
                    format!(
                        "`{}` takes at most {} but {} given",
                        sig.name,
                        plural(sig.params.len(), "argument"),
                        were(positional.len())
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
                    let mut d = Diagnostic::error(Code::E0104, format!("argument `{}` is given twice", name.name))
                        .primary(arg.span, "given again here");
                    if let Some(first) = positional.get(i) {
                        d = d.secondary(first.span, format!("first given here, as argument {}", i + 1));
                    }
                    self.report(d);
                    ok = false;
                }
                Some(i) => bound[i] = Some(&arg.value),
                None => {
                    let mut d =
                        Diagnostic::error(Code::E0104, format!("`{}` has no argument named `{}`", sig.name, name.name))
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
                    Code::E0103,
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
