//! Name resolution, before anything is instantiated: every name and callee in every forward, layer declaration
//! and block parameter default must refer to something, whether or not the code ever runs. Elaboration runs a
//! block's forward only where the block is called and stops at its first `return`; this pass is what checks a
//! block that is never called and the statements after a `return`.
//!
//! It also checks what does not depend on values: a block's second `forward`, `output` inside a block,
//! statements after a `return`, a block forward without `return`, and layers named like a config value or (at the
//! root) an input. What it reports, elaboration does not report again (see `Elab::resolved_errors`).

use super::eval::SCALAR_FUNCTIONS;
use super::{Elab, MAX_NAME_SEARCHES, Place, clash, duplicate, layers, ops, suggest};
use crate::diag::{Code, Diagnostic};
use crate::syntax::ast::{BlockDef, Call, Expr, ExprKind, ForwardDef, Ident, LayerDecl, LayerExpr, Stmt};
use optimus_plan::span::Span;
use std::collections::{HashMap, HashSet};

/// Names visible everywhere (config values), or in the model's forward only (inputs), with their definitions.
struct Globals<'f> {
    config: HashMap<&'f str, &'f Ident>,
    inputs: HashMap<&'f str, &'f Ident>,
}

/// What the names of one piece of code may refer to, besides config values.
struct Scope<'s, 'f> {
    place: Place,
    /// Block parameters visible here (in a parameter default, only the ones before it).
    params: &'s HashSet<&'f str>,
    /// The module's layers: callable, and nameable (naming one without calling it is elaboration's error).
    layers: &'s HashSet<&'f str>,
    /// In a forward: its parameters and the names assigned so far.
    locals: HashSet<&'f str>,
}

impl<'f> Elab<'f> {
    /// Resolves every name of the file; see the module documentation.
    pub(super) fn resolve_names(&mut self) {
        let file = self.file;
        let mut globals = Globals { config: HashMap::new(), inputs: HashMap::new() };
        for c in &file.config {
            globals.config.entry(c.name.name.as_str()).or_insert(&c.name);
        }
        for i in &file.inputs {
            globals.inputs.entry(i.name.name.as_str()).or_insert(&i.name);
        }

        let no_params = HashSet::new();
        let root_layers: HashSet<&str> = file.layers.iter().map(|l| l.name.name.as_str()).collect();
        self.check_layer_names(None, &file.layers, &globals);
        let declaration =
            Scope { place: Place::Declaration, params: &no_params, layers: &root_layers, locals: HashSet::new() };
        for layer in &file.layers {
            self.resolve_layer(layer, &declaration, &globals);
        }
        for forward in &file.forwards {
            self.resolve_forward(forward, None, &no_params, &root_layers, &globals);
        }

        for (index, block) in file.blocks.iter().enumerate() {
            self.resolve_block(index, block, &globals);
        }
    }

    fn resolve_block(&mut self, index: usize, block: &'f BlockDef, globals: &Globals<'f>) {
        if self.report_repeated_names("block parameter", block.params.iter().map(|p| &p.name)) {
            self.blocks_with_repeated_params.insert(index);
        }
        let mut params = HashSet::new();
        let no_layers = HashSet::new();
        for param in &block.params {
            // A default sees the parameters before it.
            if let Some(default) = &param.default {
                let scope =
                    Scope { place: Place::Default, params: &params, layers: &no_layers, locals: HashSet::new() };
                self.resolve_expr(default, &scope, globals);
            }
            params.insert(param.name.name.as_str());
        }
        let layers: HashSet<&str> = block.layers.iter().map(|l| l.name.name.as_str()).collect();
        self.check_layer_names(Some(index), &block.layers, globals);
        let declaration = Scope { place: Place::Declaration, params: &params, layers: &layers, locals: HashSet::new() };
        for layer in &block.layers {
            self.resolve_layer(layer, &declaration, globals);
        }
        if let Some((first, extra)) = block.forwards.split_first() {
            for extra in extra {
                self.report(
                    Diagnostic::error(Code::E0105, format!("block `{}` has more than one `forward`", block.name.name))
                        .primary(extra.head_span, "second `forward`")
                        .secondary(first.head_span, "first defined here")
                        .help("a block has one forward; remove or merge the other"),
                );
            }
        }
        for forward in &block.forwards {
            self.resolve_forward(forward, Some(block), &params, &layers, globals);
        }
    }

    /// Layers named like an input at the root would hide it: each is an error. A layer may share a config
    /// value's name (Hugging Face's `layers`): a call names the layer, any other use the value.
    fn check_layer_names(&mut self, block: Option<usize>, decls: &'f [LayerDecl], globals: &Globals<'f>) {
        let mut seen = HashSet::new();
        for decl in decls {
            let name = decl.name.name.as_str();
            // A repeated layer name is reported as a duplicate layer; its first declaration is checked here.
            if !seen.insert(name) {
                continue;
            }
            let Some(input) = globals.inputs.get(name).filter(|_| block.is_none()) else { continue };
            let other = ("input", *input);
            self.report(clash(other, ("layer", &decl.name)));
            self.clashing_layers.insert((block, name.to_string()));
        }
    }

    /// A forward: names in statement order, and (in a block) where it returns.
    fn resolve_forward(
        &mut self,
        forward: &'f ForwardDef,
        block: Option<&'f BlockDef>,
        params: &HashSet<&'f str>,
        layers: &HashSet<&'f str>,
        globals: &Globals<'f>,
    ) {
        let place = if block.is_some() { Place::BlockForward } else { Place::ModelForward };
        // The model's forward takes no parameters at all, which elaboration reports.
        if block.is_some() && self.report_repeated_names("forward parameter", &forward.params) {
            self.forwards_with_repeated_params.insert(forward.head_span);
        }
        let locals = forward.params.iter().map(|p| p.name.as_str()).collect();
        let mut scope = Scope { place, params, layers, locals };
        let mut returns: Option<Span> = None;
        // The statements after the first `return`: their span and how many there are.
        let mut unreachable: Option<(Span, usize)> = None;
        for stmt in &forward.body {
            if block.is_some() && returns.is_some() {
                unreachable = Some(unreachable.map_or((stmt.span(), 1), |(u, n)| (u.to(stmt.span()), n + 1)));
            }
            match stmt {
                Stmt::Assign { name, value, .. } => {
                    self.resolve_expr(value, &scope, globals);
                    scope.locals.insert(&name.name);
                }
                Stmt::Output { name, value, .. } => {
                    if block.is_some() {
                        self.report(
                            Diagnostic::error(Code::E0401, "`output` is only allowed in the model's forward")
                                .primary(name.span, "inside a block")
                                .help("return the value with `return` and output it from the model's forward"),
                        );
                    }
                    self.resolve_expr(value, &scope, globals);
                    scope.locals.insert(&name.name);
                }
                Stmt::Return { value, span } => {
                    self.resolve_expr(value, &scope, globals);
                    returns.get_or_insert(*span);
                }
            }
        }
        let Some(block) = block else { return };
        match (returns, unreachable) {
            (Some(at), Some((after, count))) => self.report(
                Diagnostic::error(
                    Code::E0401,
                    if count == 1 {
                        "unreachable statement after `return`"
                    } else {
                        "unreachable statements after `return`"
                    },
                )
                .primary(after, if count == 1 { "never runs" } else { "never run" })
                .secondary(at, "the forward returns here")
                .help(if count == 1 {
                    "remove it, or move it before the `return`"
                } else {
                    "remove them, or move them before the `return`"
                }),
            ),
            (Some(_), None) => {}
            (None, _) => self.report(
                Diagnostic::error(
                    Code::E0401,
                    format!("the forward of block `{}` does not return a value", block.name.name),
                )
                .primary(forward.head_span, "no `return` in this forward")
                .help("end the forward with `return expression`"),
            ),
        }
    }

    /// The arguments of a layer declaration, and what it instantiates.
    fn resolve_layer(&mut self, decl: &'f LayerDecl, scope: &Scope<'_, 'f>, globals: &Globals<'f>) {
        match &decl.value {
            LayerExpr::Call(call) => {
                let kind = call.callee.name.as_str();
                if !layers::is_layer_kind(kind) && !self.blocks.contains_key(kind) {
                    let d = self.unknown_layer_kind(call);
                    self.report_resolved(call.callee.span, d);
                }
                // `tied:` (the fifth argument of `linear`) names a layer or a path; elaboration resolves it.
                let mut position = 0;
                for arg in &call.args {
                    let tied = kind == "linear"
                        && match &arg.name {
                            Some(name) => name.name == "tied",
                            None => {
                                position += 1;
                                position == 5
                            }
                        };
                    if !tied {
                        self.resolve_expr(&arg.value, scope, globals);
                    }
                }
            }
            LayerExpr::Repeat { count, body, .. } => {
                self.resolve_expr(count, scope, globals);
                if !self.blocks.contains_key(&body.callee.name) {
                    let d = self.not_a_block(body);
                    self.report_resolved(body.callee.span, d);
                }
                for arg in &body.args {
                    self.resolve_expr(&arg.value, scope, globals);
                }
            }
        }
    }

    /// Every name and callee in an expression. Iterative: a sum may be a thousand operators deep.
    fn resolve_expr(&mut self, expr: &'f Expr, scope: &Scope<'_, 'f>, globals: &Globals<'f>) {
        let mut pending = vec![expr];
        while let Some(e) = pending.pop() {
            match &e.kind {
                ExprKind::Name(name) => self.resolve_name(name, e.span, scope, globals),
                ExprKind::Call(call) => {
                    self.resolve_callee(call, scope);
                    pending.extend(call.args.iter().rev().map(|a| &a.value));
                }
                ExprKind::List(items) => pending.extend(items.iter().rev()),
                ExprKind::Neg(inner) => pending.push(inner),
                ExprKind::Binary { lhs, rhs, .. } => {
                    pending.push(rhs);
                    pending.push(lhs);
                }
                ExprKind::Int(_) | ExprKind::Float(_) | ExprKind::Str(_) | ExprKind::Bool(_) | ExprKind::Invalid => {}
            }
        }
    }

    fn resolve_name(&mut self, name: &str, span: Span, scope: &Scope<'_, 'f>, globals: &Globals<'f>) {
        let known = scope.locals.contains(name)
            || scope.params.contains(name)
            || scope.layers.contains(name)
            || globals.config.contains_key(name);
        if known || (scope.place == Place::ModelForward && globals.inputs.contains_key(name)) {
            return;
        }
        let d = if globals.inputs.contains_key(name) {
            input_misuse(name, span, scope.place)
        } else {
            self.unknown_name(name, span, |_| {
                let mut names: Vec<String> = scope
                    .locals
                    .iter()
                    .chain(scope.params)
                    .chain(globals.config.keys())
                    .map(|n| n.to_string())
                    .collect();
                if scope.place == Place::ModelForward {
                    names.extend(globals.inputs.keys().map(|n| n.to_string()));
                }
                names
            })
        };
        self.report_resolved(span, d);
    }

    fn resolve_callee(&mut self, call: &Call, scope: &Scope<'_, 'f>) {
        let name = call.callee.name.as_str();
        if scope.layers.contains(name) || SCALAR_FUNCTIONS.contains(&name) || ops::is_function(name) {
            return;
        }
        let d = self.bad_callee(call, scope.layers.iter().copied());
        self.report_resolved(call.callee.span, d);
    }

    /// Reports each name of a parameter list that repeats an earlier one (E0105, calling it `what`); whether
    /// there was any.
    fn report_repeated_names(&mut self, what: &str, names: impl IntoIterator<Item = &'f Ident>) -> bool {
        let mut seen: HashMap<&str, Span> = HashMap::new();
        let mut repeated = false;
        for name in names {
            match seen.get(name.name.as_str()) {
                Some(&first) => {
                    self.report(duplicate(what, name, first));
                    repeated = true;
                }
                None => {
                    seen.insert(&name.name, name.span);
                }
            }
        }
        repeated
    }

    /// Reports an error about the name or callee at `span`, which elaboration then leaves alone.
    fn report_resolved(&mut self, span: Span, d: Diagnostic) {
        self.resolved_errors.insert(span);
        self.report(d);
    }

    /// "unknown name `x`", with the closest of `candidates` while suggestions are still being searched for.
    pub(super) fn unknown_name(
        &mut self,
        name: &str,
        span: Span,
        candidates: impl FnOnce(&Self) -> Vec<String>,
    ) -> Diagnostic {
        let mut d = Diagnostic::error(Code::E0101, format!("unknown name `{name}`")).primary(span, "not defined");
        // Each search compares the name with every name in scope; after many unknown names, stop searching.
        if self.name_searches < MAX_NAME_SEARCHES {
            self.name_searches += 1;
            let names = candidates(self);
            if let Some(s) = suggest(name, names.iter().map(String::as_str)) {
                d = d.help(format!("did you mean `{s}`?"));
            }
        }
        d
    }

    /// A call in an expression to something that cannot be called there: a block or layer kind (which must be
    /// declared as a layer first), or an unknown name.
    pub(super) fn bad_callee<'n>(&mut self, call: &Call, layer_names: impl Iterator<Item = &'n str>) -> Diagnostic {
        let name = call.callee.name.as_str();
        if layers::is_layer_kind(name) || self.blocks.contains_key(name) {
            let what = if self.blocks.contains_key(name) { "block" } else { "layer kind" };
            return Diagnostic::error(
                Code::E0107,
                format!("`{name}` is a {what}; it must be declared as a layer before it is called"),
            )
            .primary(call.callee.span, "cannot be called here")
            .help(format!("declare it with `layer my_{name} = {name}(...)` and call `my_{name}(x)`"));
        }
        let mut d = Diagnostic::error(Code::E0102, format!("unknown operator `{name}`"))
            .primary(call.callee.span, "not an operator or layer");
        if self.name_searches < MAX_NAME_SEARCHES {
            self.name_searches += 1;
            let mut candidates: Vec<&str> = ops::function_names().collect();
            candidates.extend(SCALAR_FUNCTIONS);
            candidates.extend(layer_names);
            if let Some(s) = suggest(name, candidates) {
                d = d.help(format!("did you mean `{s}`?"));
            }
        }
        d
    }
}

/// A model input named where only the model's forward may name it.
pub(super) fn input_misuse(name: &str, span: Span, place: Place) -> Diagnostic {
    match place {
        Place::ModelForward | Place::BlockForward => {
            Diagnostic::error(Code::E0101, format!("input `{name}` is not visible inside a block"))
                .primary(span, "model inputs are only visible in the model's forward")
                .help("pass it to the block as an argument")
        }
        Place::Declaration => Diagnostic::error(
            Code::E0107,
            format!("`{name}` is a model input, but layer arguments must be sizes, not tensors"),
        )
        .primary(span, "a tensor")
        .help(format!(
            "give sizes here (numbers or config values), and apply the layer to `{name}` in the model's `forward`"
        )),
        Place::Default => Diagnostic::error(
            Code::E0107,
            format!(
                "`{name}` is a model input, but block parameters must be numbers, booleans or strings, not tensors"
            ),
        )
        .primary(span, "a tensor")
        .help("pass tensors to the block's forward instead"),
        Place::Config => Diagnostic::error(
            Code::E0107,
            format!("`{name}` is a model input, but config values and input dimensions must be numbers, not tensors"),
        )
        .primary(span, "a tensor"),
    }
}
