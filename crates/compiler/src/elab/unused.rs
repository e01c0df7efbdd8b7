//! Warnings for declarations that do nothing: an input the model's forward never reads (W0001: the plan
//! has no place for it, and `run` reads no data for it) and a layer no forward of its scope calls and no
//! called layer ties to (W0002: it has no parameters in the plan). Both are found on the syntax tree:
//! an input is read where its name is a value before any local of that name is assigned; a layer is
//! used where its name is called, or named by the `tied:` of a called layer in any scope (a block's tie
//! may name a root embedding). Where that cannot be told by name (a tie by path string), nothing is
//! reported: the pass never warns of something used.

use crate::diag::{Code, Diagnostic};
use crate::syntax::ast::{Call, Expr, ExprKind, File, ForwardDef, LayerDecl, LayerExpr, Stmt};
use std::collections::HashSet;

/// The warnings of `file`, in declaration order: inputs first, then the root's layers, then each block's.
pub(super) fn unused_declarations(file: &File) -> Vec<Diagnostic> {
    let read = inputs_read(&file.forwards);
    let mut warnings: Vec<Diagnostic> =
        file.inputs.iter().filter(|i| !read.contains(i.name.name.as_str())).map(|i| unread_input(&i.name)).collect();
    let scopes: Vec<(Option<&str>, &[LayerDecl], HashSet<&str>)> =
        std::iter::once((None, &file.layers[..], &file.forwards))
            .chain(file.blocks.iter().map(|b| (Some(b.name.name.as_str()), &b.layers[..], &b.forwards)))
            .map(|(block, layers, forwards)| (block, layers, callees(forwards)))
            .collect();
    // Ties of the layers that are called, in every scope.
    let mut tied_by_name = HashSet::new();
    let mut tied_by_path = false;
    for (_, layers, called) in &scopes {
        for decl in layers.iter().filter(|d| called.contains(d.name.name.as_str())) {
            match tie_of(decl).map(|tie| &tie.kind) {
                Some(ExprKind::Name(name)) => {
                    tied_by_name.insert(name.as_str());
                }
                Some(ExprKind::Str(_)) => tied_by_path = true,
                _ => {}
            }
        }
    }
    for (block, layers, called) in &scopes {
        for decl in layers.iter() {
            let name = decl.name.name.as_str();
            let used = called.contains(name) || tied_by_name.contains(name) || (tied_by_path && is_embedding(decl));
            if !used {
                warnings.push(uncalled_layer(decl, *block));
            }
        }
    }
    warnings
}

fn unread_input(name: &crate::syntax::ast::Ident) -> Diagnostic {
    Diagnostic::warning(Code::W0001, format!("input `{}` is never read", name.name))
        .primary(name.span, "declared here, and read nowhere in the model's forward")
        .note("the plan has no place for it, and `run` reads no data for it")
        .help("read it in the forward, or remove the declaration")
}

fn uncalled_layer(decl: &LayerDecl, block: Option<&str>) -> Diagnostic {
    let place = block.map_or_else(|| "the model's forward".to_string(), |b| format!("the forward of block `{b}`"));
    Diagnostic::warning(Code::W0002, format!("layer `{}` is never called", decl.name.name))
        .primary(decl.name.span, format!("declared here, and called nowhere in {place}"))
        .note("`compile` leaves its parameters out of the plan")
        .help("call it in the forward, or remove the declaration")
}

/// The names the model's forward reads as values before assigning a local of that name: the inputs it
/// reads (a call never names an input).
fn inputs_read(forwards: &[ForwardDef]) -> HashSet<&str> {
    let mut read = HashSet::new();
    for forward in forwards {
        let mut assigned: HashSet<&str> = forward.params.iter().map(|p| p.name.as_str()).collect();
        for stmt in &forward.body {
            let (name, value) = match stmt {
                Stmt::Assign { name, value, .. } | Stmt::Output { name, value, .. } => (Some(name), value),
                Stmt::Return { value, .. } => (None, value),
            };
            let (values, _) = names_in(value);
            read.extend(values.into_iter().filter(|v| !assigned.contains(v)));
            if let Some(name) = name {
                assigned.insert(name.name.as_str());
            }
        }
    }
    read
}

/// The names called in `forwards`' statements.
fn callees(forwards: &[ForwardDef]) -> HashSet<&str> {
    let mut called = HashSet::new();
    for forward in forwards {
        for stmt in &forward.body {
            let (Stmt::Assign { value, .. } | Stmt::Output { value, .. } | Stmt::Return { value, .. }) = stmt;
            called.extend(names_in(value).1);
        }
    }
    called
}

/// The names an expression reads as values, and the names it calls.
fn names_in(expr: &Expr) -> (Vec<&str>, Vec<&str>) {
    let (mut values, mut calls) = (Vec::new(), Vec::new());
    let mut pending = vec![expr];
    while let Some(expr) = pending.pop() {
        match &expr.kind {
            ExprKind::Name(name) => values.push(name.as_str()),
            ExprKind::Call(call) => {
                calls.push(call.callee.name.as_str());
                pending.extend(call.args.iter().map(|a| &a.value));
            }
            ExprKind::List(items) => pending.extend(items),
            ExprKind::Neg(inner) => pending.push(inner),
            ExprKind::Binary { lhs, rhs, .. } => pending.extend([&**lhs, &**rhs]),
            ExprKind::Int(_) | ExprKind::Float(_) | ExprKind::Str(_) | ExprKind::Bool(_) | ExprKind::Invalid => {}
        }
    }
    (values, calls)
}

/// The `tied:` argument of a `linear` declaration: by keyword, or its fifth positional argument.
fn tie_of(decl: &LayerDecl) -> Option<&Expr> {
    let LayerExpr::Call(call) = &decl.value else { return None };
    if call.callee.name != "linear" {
        return None;
    }
    keyword_or_position(call, "tied", 4)
}

fn keyword_or_position<'c>(call: &'c Call, keyword: &str, position: usize) -> Option<&'c Expr> {
    let by_keyword = call.args.iter().find(|a| a.name.as_ref().is_some_and(|n| n.name == keyword));
    by_keyword.or_else(|| call.args.iter().filter(|a| a.name.is_none()).nth(position)).map(|a| &a.value)
}

fn is_embedding(decl: &LayerDecl) -> bool {
    matches!(&decl.value, LayerExpr::Call(call) if call.callee.name == "embedding")
}
