//! E0602's help names exactly the meshes that compile: for several models and failing meshes, every
//! mesh it suggests compiles, and every other mesh of the strategy within the bound it states does not.

use optimus::diag::Diagnostic;
use optimus::elab::Override;
use optimus::front::check_source;
use optimus::ir::Model;
use optimus::plan::{Mesh, Mode, Strategy};
use optimus::shard::{Target, compile};
use std::path::Path;

/// A model that does not shard on one mesh, and the mesh.
struct Case {
    model: &'static str,
    sets: &'static [(&'static str, &'static str)],
    strategy: Strategy,
    mesh: (u64, u64),
    mode: Mode,
}

impl Case {
    fn target(&self, mesh: Mesh) -> Target {
        Target::plain(mesh, self.strategy, self.mode)
    }

    fn failing(&self) -> Target {
        self.target(Mesh::new(self.mesh.0, self.mesh.1))
    }

    fn name(&self) -> String {
        let t = self.failing();
        format!("{} {:?} {} {} {:?}", self.model, self.sets, t.strategy.name(), t.mesh, t.mode)
    }
}

/// One layer keeps every dimension the examples split while making each compile cheap.
const ONE_LAYER: &[(&str, &str)] = &[("layers", "1")];

/// Sizes that share few factors with the mesh sides: a prime vocabulary, 6 heads of 6.
const ODD_SIZES: &[(&str, &str)] = &[("vocab", "97"), ("hidden", "36"), ("heads", "6"), ("batch", "12")];

fn cases() -> Vec<Case> {
    let case = |model, sets, strategy, mesh, mode| Case { model, sets, strategy, mesh, mode };
    vec![
        case("gpt2", ONE_LAYER, Strategy::Megatron, (1, 16), Mode::Train),
        case("gpt2", ONE_LAYER, Strategy::Megatron, (1, 5), Mode::Train),
        case("gpt2", ONE_LAYER, Strategy::Optimus, (3, 3), Mode::Infer),
        case("tiny", &[], Strategy::Optimus, (3, 3), Mode::Train),
        case("tiny", &[], Strategy::Megatron, (1, 3), Mode::Train),
        case("bert", ONE_LAYER, Strategy::Optimus, (3, 3), Mode::Train),
        case("bert", ONE_LAYER, Strategy::Megatron, (1, 5), Mode::Infer),
        case("tiny", ODD_SIZES, Strategy::Optimus, (5, 5), Mode::Train),
        case("tiny", ODD_SIZES, Strategy::Megatron, (1, 5), Mode::Train),
        case("tiny", &[], Strategy::Tesseract, (3, 3), Mode::Train),
        case("tiny", ODD_SIZES, Strategy::Tesseract, (5, 5), Mode::Train),
    ]
}

fn source(model: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples").join(format!("{model}.opt"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn checked(text: &str, sets: &[(&str, &str)]) -> Model {
    let overrides: Vec<Override> =
        sets.iter().map(|(k, v)| Override { name: (*k).to_string(), value: (*v).to_string() }).collect();
    let c = check_source(text, &overrides);
    assert!(!c.diagnostics.iter().any(Diagnostic::is_error), "{sets:?} should check: {:#?}", c.diagnostics);
    c.model.expect("a model without errors")
}

/// The bound and the meshes E0602's help states, the same on every E0602.
fn suggestion(diagnostics: &[Diagnostic], case: &str) -> (u64, Vec<Mesh>) {
    let helps: Vec<&str> = diagnostics.iter().filter(|d| d.code == "E0602").filter_map(|d| d.help.as_deref()).collect();
    assert!(!helps.is_empty(), "{case}: expected E0602 with help, got {diagnostics:#?}");
    assert!(helps.iter().all(|h| h == &helps[0]), "{case}: every E0602 gives the same help: {helps:#?}");
    let help = helps[0];
    let rest = help.strip_prefix("meshes up to ").unwrap_or_else(|| panic!("{case}: help states its bound: {help}"));
    let (bound, rest) = rest.split_once(" devices on which this model compiles").expect("the bound in devices");
    let (_, list) = rest.split_once(": ").expect("the list after the colon");
    let meshes = list.split(", ").map(|m| parse_mesh(m).unwrap_or_else(|| panic!("{case}: mesh `{m}`"))).collect();
    (bound.parse().expect("a numeric bound"), meshes)
}

/// `RxC`, or `DxRxC` for D depth layers (the suggestions list only tensor-parallel meshes).
fn parse_mesh(text: &str) -> Option<Mesh> {
    let sizes: Vec<u64> = text.split('x').map(str::parse).collect::<Result<_, _>>().ok()?;
    match sizes[..] {
        [rows, cols] => Some(Mesh::new(rows, cols)),
        [depth, rows, cols] => Some(Mesh::new(rows, cols).with_depth(depth)),
        _ => None,
    }
}

/// Every mesh the strategy accepts with at most `bound` devices.
fn meshes_within(strategy: Strategy, bound: u64) -> Vec<Mesh> {
    let mut meshes = Vec::new();
    for rows in 1..=bound {
        for cols in 1..=bound / rows {
            for depth in 1..=bound / (rows * cols) {
                let fits = match strategy {
                    Strategy::Optimus => rows == cols && depth == 1,
                    Strategy::Tesseract => rows == cols,
                    Strategy::ThreeD => rows == cols && cols == depth,
                    Strategy::Megatron => rows == 1 && depth == 1,
                    Strategy::None => rows * cols == 1 && depth == 1,
                };
                if fits {
                    meshes.push(Mesh::new(rows, cols).with_depth(depth));
                }
            }
        }
    }
    meshes
}

#[test]
fn suggested_meshes_are_exactly_those_that_compile() {
    for case in cases() {
        let name = case.name();
        let text = source(case.model);
        let model = checked(&text, case.sets);
        let diagnostics = compile(&model, case.model, &text, case.failing()).expect_err(&name);
        let (bound, suggested) = suggestion(&diagnostics, &name);
        assert_eq!(bound, 64, "{name}: the bound stated");
        for mesh in meshes_within(case.strategy, bound) {
            let compiles = compile(&model, case.model, &text, case.target(mesh)).is_ok();
            let listed = suggested.contains(&mesh);
            assert_eq!(listed, compiles, "{name}: {mesh} listed {listed} but compiles {compiles}");
        }
        // Tesseract has several meshes of one size (4x1x1 and 2x2): by devices, then grid side.
        let order = |m: &Mesh| (m.devices(), m.rows);
        assert!(suggested.windows(2).all(|w| order(&w[0]) < order(&w[1])), "{name}: smallest first");
    }
}

/// The meshes the issue found missing: 1x3 and 1x12 for GPT-2 with megatron, 4x4 for tiny at 3x3.
#[test]
fn the_examples_get_the_meshes_they_compile_on() {
    let expected = [
        ("gpt2", Strategy::Megatron, (1, 16), "1x1, 1x2, 1x3, 1x4, 1x6, 1x12"),
        ("tiny", Strategy::Optimus, (3, 3), "1x1, 2x2, 4x4, 8x8"),
    ];
    for (model, strategy, (rows, cols), meshes) in expected {
        let text = source(model);
        let target = Target::plain(Mesh::new(rows, cols), strategy, Mode::Train);
        let diagnostics = compile(&checked(&text, &[]), model, &text, target).expect_err(model);
        let help = format!(
            "meshes up to 64 devices on which this model compiles with the {} strategy: {meshes}",
            strategy.name()
        );
        let d = diagnostics.iter().find(|d| d.code == "E0602").expect("an E0602");
        assert_eq!(d.help.as_deref(), Some(help.as_str()), "{model} on {rows}x{cols}");
    }
}

/// With replicas the batch cannot split over, no mesh of those replicas compiles: the help says so with
/// the replicas named, and lists the meshes of one replica, each of which compiles.
#[test]
fn replicas_no_mesh_takes_are_named_and_the_meshes_of_one_replica_listed() {
    let text = source("tiny");
    let model = checked(&text, &[]);
    for (replicas, grid) in [(3u64, Mesh::new(2, 2)), (16, Mesh::new(1, 1))] {
        let failing = Target::plain(grid.with_data(replicas), Strategy::Optimus, Mode::Train);
        let diagnostics = compile(&model, "tiny", &text, failing).expect_err("batch 8 does not split");
        let help = diagnostics.iter().find(|d| d.code == "E0602").and_then(|d| d.help.clone()).expect("help");
        let named =
            format!("with the optimus strategy and {replicas} data-parallel replicas: none; with one replica: ");
        let (_, listed) = help.split_once(&named).unwrap_or_else(|| panic!("{help}"));
        let meshes: Vec<Mesh> = listed.split(", ").map(|m| parse_mesh(m).unwrap_or_else(|| panic!("{m}"))).collect();
        assert!(meshes.contains(&grid), "{help}: the grid itself, with one replica");
        for mesh in meshes_within(Strategy::Optimus, 64) {
            let compiles = compile(&model, "tiny", &text, Target::plain(mesh, Strategy::Optimus, Mode::Train)).is_ok();
            assert_eq!(meshes.contains(&mesh), compiles, "{help}: {mesh}");
        }
    }
}
