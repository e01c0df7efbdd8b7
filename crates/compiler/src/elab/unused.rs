//! Warnings for declarations that do nothing: an input the model's forward never reads (W0001: the plan
//! has no place for it, and `run` reads no data for it) and a layer no forward of its scope calls or ties
//! to (W0002: it has no parameters in the plan). Both are found on the syntax tree, by name, so a name
//! that appears anywhere it could refer to the declaration counts as a use: the pass never warns of
//! something used.

use crate::diag::{Code, Diagnostic};
use crate::syntax::ast::{Expr, ExprKind, File, ForwardDef, LayerDecl, LayerExpr, Stmt};
use std::collections::HashSet;

/// The warnings of `file`, in declaration order: inputs first, then the root's layers, then each block's.
pub(super) fn unused_declarations(file: &File) -> Vec<Diagnostic> {
    let mut warnings = Vec::new();
    let root_names = names_in(&file.forwards, &file.layers);
    for input in &file.inputs {
        if !root_names.contains(input.name.name.as_str()) {
            warnings.push(
                Diagnostic::warning(Code::W0001, format!("input `{}` is never read", input.name.name))
                    .primary(input.name.span, "declared here, and read nowhere in the model's forward")
                    .note("the plan has no place for it, and `run` reads no data for it")
                    .help("read it in the forward, or remove the declaration"),
            );
        }
    }
    // A string `tied:` names a layer by its path, which may be any embedding of any block.
    let tied_by_path = has_tied_path(file);
    let scopes = std::iter::once((None, &file.layers, root_names))
        .chain(file.blocks.iter().map(|b| (Some(b.name.name.as_str()), &b.layers, names_in(&b.forwards, &b.layers))));
    for (block, layers, used) in scopes {
        for decl in layers {
            let may_be_tied_to = tied_by_path && is_embedding(decl);
            if !used.contains(decl.name.name.as_str()) && !may_be_tied_to {
                warnings.push(uncalled_layer(decl, block));
            }
        }
    }
    warnings
}

fn uncalled_layer(decl: &LayerDecl, block: Option<&str>) -> Diagnostic {
    let place = block.map_or_else(|| "the model's forward".to_string(), |b| format!("the forward of block `{b}`"));
    Diagnostic::warning(Code::W0002, format!("layer `{}` is never called", decl.name.name))
        .primary(decl.name.span, format!("declared here, and called nowhere in {place}"))
        .note("`compile` leaves its parameters out of the plan")
        .help("call it in the forward, or remove the declaration")
}

/// Every name and callee written in `forwards` and in the arguments of `layers` (where `tied: wte`
/// names a layer of the same scope).
fn names_in<'f>(forwards: &'f [ForwardDef], layers: &'f [LayerDecl]) -> HashSet<&'f str> {
    let mut names = HashSet::new();
    let mut pending: Vec<&Expr> = Vec::new();
    for forward in forwards {
        pending.extend(forward.body.iter().map(|stmt| match stmt {
            Stmt::Assign { value, .. } | Stmt::Output { value, .. } | Stmt::Return { value, .. } => value,
        }));
    }
    for decl in layers {
        match &decl.value {
            LayerExpr::Call(call) => pending.extend(call.args.iter().map(|a| &a.value)),
            LayerExpr::Repeat { count, body, .. } => {
                pending.push(count);
                pending.extend(body.args.iter().map(|a| &a.value));
            }
        }
    }
    while let Some(expr) = pending.pop() {
        match &expr.kind {
            ExprKind::Name(name) => {
                names.insert(name.as_str());
            }
            ExprKind::Call(call) => {
                names.insert(call.callee.name.as_str());
                pending.extend(call.args.iter().map(|a| &a.value));
            }
            ExprKind::List(items) => pending.extend(items),
            ExprKind::Neg(inner) => pending.push(inner),
            ExprKind::Binary { lhs, rhs, .. } => pending.extend([&**lhs, &**rhs]),
            ExprKind::Int(_) | ExprKind::Float(_) | ExprKind::Str(_) | ExprKind::Bool(_) | ExprKind::Invalid => {}
        }
    }
    names
}

/// Whether any layer of the file is tied by a path string (`tied: "bert.embeddings.word_embeddings"`).
fn has_tied_path(file: &File) -> bool {
    let decls = file.layers.iter().chain(file.blocks.iter().flat_map(|b| &b.layers));
    decls.filter_map(|d| if let LayerExpr::Call(call) = &d.value { Some(call) } else { None }).any(|call| {
        // `tied:` by keyword, or a string among `linear`'s positional arguments (its fifth is `tied`; no
        // other argument of a model without errors is a string).
        call.args.iter().filter(|a| matches!(a.value.kind, ExprKind::Str(_))).any(|a| match &a.name {
            Some(name) => name.name == "tied",
            None => call.callee.name == "linear",
        })
    })
}

fn is_embedding(decl: &LayerDecl) -> bool {
    matches!(&decl.value, LayerExpr::Call(call) if call.callee.name == "embedding")
}
