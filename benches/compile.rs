//! Compile-time benchmark: GPT-3 175B (examples/gpt3.opt, 96 layers) for training on an 8x8 optimus mesh.
//!
//! `library` measures the library's work (check the source, then shard and lower it into a verified
//! plan); `command` adds the JSON serialisation that `optimusc compile` does before writing the file,
//! which is the whole command's work but for reading and writing files. The target is under 100 ms.

use criterion::{Criterion, criterion_group, criterion_main};
use optimus::front::check_source;
use optimus::plan::{Mesh, Mode, Plan, Strategy};
use optimus::shard::{Target, compile};
use std::hint::black_box;

const NAME: &str = "examples/gpt3.opt";
const SOURCE: &str = include_str!("../examples/gpt3.opt");
const TARGET: Target = Target::plain(Mesh::new(8, 8), Strategy::Optimus, Mode::Train);

/// Checks and compiles the model; panics (failing the benchmark) if either step reports errors.
fn check_and_compile(source: &str) -> Plan {
    let checked = check_source(source, &[]);
    let Some(model) = checked.model else { panic!("gpt3.opt does not check: {:?}", checked.diagnostics) };
    match compile(&model, NAME, source, TARGET) {
        Ok(plan) => plan,
        Err(diagnostics) => panic!("gpt3.opt does not compile for 8x8: {diagnostics:?}"),
    }
}

fn bench_compile(c: &mut Criterion) {
    let mut group = c.benchmark_group("gpt3_train_8x8");
    group.sample_size(20);
    group.bench_function("library", |b| b.iter(|| check_and_compile(black_box(SOURCE))));
    group.bench_function("command", |b| {
        b.iter(|| {
            let plan = check_and_compile(black_box(SOURCE));
            match serde_json::to_vec(&plan) {
                Ok(json) => json,
                Err(e) => panic!("the plan does not serialise: {e}"),
            }
        });
    });
    group.finish();
}

criterion_group!(benches, bench_compile);
criterion_main!(benches);
