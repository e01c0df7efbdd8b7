//! `optimusc run --profile` end to end: the profile counts every instruction of the compiled plan once
//! per device and profiled step, its shares add up, and its product FLOPs match 2mnk computed here from
//! the plan's own buffer shapes. No timing is asserted beyond "positive".

mod common;

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output};

fn optimusc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs")
}

fn scratch(name: &str) -> PathBuf {
    let dir = common::process_dir("profile-cli");
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

/// `mat_mul` -> `MatMul`: the plan's JSON kernel kind as the profile names it (the Rust variant).
fn variant_name(snake: &str) -> String {
    snake
        .split('_')
        .map(|word| {
            let mut chars = word.chars();
            chars.next().map(|c| c.to_ascii_uppercase().to_string() + chars.as_str()).unwrap_or_default()
        })
        .collect()
}

fn as_u64(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("{v} is not an unsigned integer"))
}

fn shape(plan: &Value, buffer: &Value) -> Vec<u64> {
    plan["buffers"][as_u64(buffer) as usize]["shape"].as_array().expect("a shape").iter().map(as_u64).collect()
}

/// (leading dimensions flattened, last dimension).
fn rows_and_last(shape: &[u64]) -> (u64, u64) {
    match shape.split_last() {
        Some((last, lead)) => (lead.iter().product(), *last),
        None => (1, 1),
    }
}

/// Instructions of each profile row in one step of one device, by row name.
fn instructions_by_row(plan: &Value) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for instr in plan["program"].as_array().expect("a program") {
        let name = match instr["instr"].as_str() {
            Some("kernel") => variant_name(instr["kernel"]["kind"].as_str().expect("a kernel kind")),
            Some("collective") => {
                let c = &instr["collective"];
                format!("{} ({})", c["kind"].as_str().expect("a kind"), c["group"].as_str().expect("a group"))
            }
            _ => continue,
        };
        *counts.entry(name).or_insert(0) += 1;
    }
    counts
}

/// FLOPs of one step's matrix products on one device: 2 m n k, with A's leading dimensions flattened
/// and k its rows when it is transposed.
fn matmul_flops(plan: &Value) -> u64 {
    let program = plan["program"].as_array().expect("a program");
    let products = program.iter().filter(|i| i["instr"] == "kernel" && i["kernel"]["kind"] == "mat_mul");
    products
        .map(|instr| {
            let (a_rows, a_cols) = rows_and_last(&shape(plan, &instr["inputs"][0]));
            let k = if instr["kernel"]["transpose_a"] == true { a_rows } else { a_cols };
            let (m, n) = rows_and_last(&shape(plan, &instr["output"]));
            2 * m * n * k
        })
        .sum()
}

#[test]
fn the_profile_counts_every_instruction_and_the_flops_of_every_matmul() {
    let plan_path = scratch("tiny-2x2.json");
    let plan_arg = plan_path.to_str().expect("utf-8 path");
    let compiled = optimusc(&["compile", "examples/tiny.opt", "--mesh", "2x2", "-o", plan_arg]);
    assert!(compiled.status.success(), "{}", String::from_utf8_lossy(&compiled.stderr));
    let plan: Value = serde_json::from_slice(&std::fs::read(&plan_path).expect("the plan")).expect("plan JSON");

    let out = optimusc(&["run", plan_arg, "--steps", "3", "--profile", "--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("GFLOP/s measured on") && stderr.contains("left out as warm-up"), "{stderr}");
    let records: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect();
    let (last, steps) = records.split_last().expect("records");
    assert_eq!(steps.len(), 3, "one record per step before the profile");
    let profile = &last["profile"];
    assert_eq!(profile["steps_profiled"], 2, "the first of 3 steps is warm-up");
    assert_eq!(profile["warm_up_excluded"], true);
    assert!(profile["peak_gflops"].as_f64().expect("a peak") > 0.0);
    // The peak measured before the run too, to tell whether the machine kept its speed.
    assert!(profile["peak_before_run_gflops"].as_f64().is_some_and(|g| g > 0.0), "{profile}");
    assert!(stderr.contains(" before it (") && stderr.contains("% apart)"), "{stderr}");
    assert_eq!(profile["devices"].as_array().expect("devices").len(), 4);

    let rows = profile["rows"].as_array().expect("rows");
    let per_row = |key: &str| -> BTreeMap<String, &Value> {
        rows.iter().map(|r| (r["name"].as_str().expect("a name").to_string(), &r[key])).collect()
    };
    let counted: BTreeMap<String, u64> = per_row("count").into_iter().map(|(n, c)| (n, as_u64(c))).collect();
    let expected: BTreeMap<String, u64> =
        instructions_by_row(&plan).into_iter().map(|(name, n)| (name, n * 4 * 2)).collect();
    assert_eq!(counted, expected, "4 devices x 2 steps of each instruction");

    let shares: f64 = rows.iter().map(|r| r["share_pct"].as_f64().expect("a share")).sum();
    assert!((shares - 100.0).abs() < 0.01, "shares add up to {shares}");

    let products: Vec<&Value> = rows.iter().filter(|r| !r["flops"].is_null()).collect();
    let names: Vec<&str> = products.iter().filter_map(|r| r["name"].as_str()).collect();
    assert!(names.contains(&"MatMul") && names.contains(&"Attention"), "{names:?}");
    for row in &products {
        assert!(row["gflops"].as_f64().is_some_and(|g| g > 0.0), "{row}");
        assert!(row["peak_pct"].as_f64().is_some_and(|p| p > 0.0), "{row}");
        assert!(row["gb_per_s"].is_null(), "{row}");
    }
    assert_eq!(as_u64(per_row("flops")["MatMul"]), matmul_flops(&plan) * 4 * 2);
    for row in rows.iter().filter(|r| r["category"] == "communication") {
        assert!(as_u64(&row["bytes"]) > 0 && row["gflops"].is_null(), "{row}");
    }
    the_products_by_shape_break_the_matmul_row_down(&plan, profile, &stderr);
}

/// A step's matrix products of one device by (m, k, n, form), counted from the plan here.
fn products_by_shape(plan: &Value) -> BTreeMap<(u64, u64, u64, String), u64> {
    let mut shapes = BTreeMap::new();
    for instr in plan["program"].as_array().expect("a program") {
        if instr["instr"] != "kernel" || instr["kernel"]["kind"] != "mat_mul" {
            continue;
        }
        let kernel = &instr["kernel"];
        let (ta, tb) = (kernel["transpose_a"] == true, kernel["transpose_b"] == true);
        let (a_rows, a_cols) = rows_and_last(&shape(plan, &instr["inputs"][0]));
        let k = if ta { a_rows } else { a_cols };
        let (m, n) = rows_and_last(&shape(plan, &instr["output"]));
        let form = format!(
            "{} {}{}",
            if ta { "A^T" } else { "A" },
            if tb { "B^T" } else { "B" },
            if kernel["accumulate"] == true { " +=" } else { "" }
        );
        *shapes.entry((m, k, n, form)).or_insert(0) += 1;
    }
    shapes
}

/// The profile's products by shape: every `MatMul` of the plan under its shape and form, 4 devices x 2
/// steps each, their times adding up to the `MatMul` row's, most time first, and the table printed.
fn the_products_by_shape_break_the_matmul_row_down(plan: &Value, profile: &Value, stderr: &str) {
    let products = profile["products"].as_array().expect("products by shape");
    let listed: BTreeMap<(u64, u64, u64, String), u64> = products
        .iter()
        .map(|p| {
            let form = p["form"].as_str().expect("a form").to_string();
            ((as_u64(&p["m"]), as_u64(&p["k"]), as_u64(&p["n"]), form), as_u64(&p["count"]))
        })
        .collect();
    let expected: BTreeMap<_, u64> = products_by_shape(plan).into_iter().map(|(shape, n)| (shape, n * 4 * 2)).collect();
    assert_eq!(listed, expected, "each product shape, 4 devices x 2 steps");
    let matmul = profile["rows"].as_array().expect("rows").iter().find(|r| r["name"] == "MatMul").expect("MatMul");
    let total: f64 = products.iter().map(|p| p["total_ms"].as_f64().expect("ms")).sum();
    let row_ms = matmul["total_ms"].as_f64().expect("ms");
    assert!((total - row_ms).abs() <= 1e-6 * row_ms.max(1.0), "{total} ms by shape against {row_ms} in the row");
    let times: Vec<f64> = products.iter().map(|p| p["total_ms"].as_f64().expect("ms")).collect();
    assert!(times.windows(2).all(|w| w[0] >= w[1]), "most time first: {times:?}");
    for p in products {
        let flops = 2.0 * (as_u64(&p["m"]) * as_u64(&p["k"]) * as_u64(&p["n"]) * as_u64(&p["count"])) as f64;
        let seconds = p["total_ms"].as_f64().expect("ms") / 1e3;
        let gflops = p["gflops"].as_f64().expect("GFLOP/s");
        assert!((gflops - flops / seconds / 1e9).abs() <= 1e-6 * gflops, "2mnk per second: {p}");
        assert!(p["median_gflops"].as_f64().is_some_and(|g| g > 0.0), "{p}");
        assert!(p["median_peak_pct"].as_f64().is_some_and(|g| g > 0.0), "{p}");
    }
    assert!(stderr.contains("products by shape") && stderr.contains("median % peak"), "{stderr}");
}

/// What one profiled run on a 2x2 mesh says about its products.
struct ProductsRun {
    losses: Vec<f64>,
    library: String,
    openblas_calls: u64,
    faer_calls: u64,
    optimus_calls: u64,
}

/// Per-step losses of `run --json` on a 2x2 mesh with the given `OPTIMUS_BLAS` and extra flags, and
/// the profile's library and product calls.
fn losses_with_products(blas: Option<&str>, extra: &[&str]) -> ProductsRun {
    losses_with_products_on("2x2", blas, extra, None)
}

/// As [`losses_with_products`], on `mesh` with `pool` kernel threads (`RAYON_NUM_THREADS`) if given.
fn losses_with_products_on(mesh: &str, blas: Option<&str>, extra: &[&str], pool: Option<usize>) -> ProductsRun {
    losses_with_products_env(mesh, blas, extra, (pool, None))
}

/// As [`losses_with_products_on`], with the CPU's vectors capped at `isa` (`OPTIMUS_CPU_ISA`) if given.
fn losses_with_products_env(
    mesh: &str,
    blas: Option<&str>,
    extra: &[&str],
    (pool, isa): (Option<usize>, Option<&str>),
) -> ProductsRun {
    let mut command = Command::new(env!("CARGO_BIN_EXE_optimusc"));
    if let Some(isa) = isa {
        command.env("OPTIMUS_CPU_ISA", isa);
    }
    command.args(["run", "examples/gpt2.opt", "--mesh", mesh, "--steps", "3", "--profile", "--json"]);
    if let Some(threads) = pool {
        command.env("RAYON_NUM_THREADS", threads.to_string());
    }
    command.args(extra);
    command.args(["--set", "layers=2", "--set", "hidden=64", "--set", "heads=4", "--set", "vocab=512"]);
    command.args(["--set", "seq=64", "--set", "context=64", "--set", "batch=8"]);
    match blas {
        Some(choice) => command.env("OPTIMUS_BLAS", choice),
        None => command.env_remove("OPTIMUS_BLAS"),
    };
    let out = command.output().expect("optimusc runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let records: Vec<Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("JSON")).collect();
    let losses = records.iter().filter_map(|r| r["loss"].as_f64()).collect();
    let profile = &records.last().expect("a profile record")["profile"];
    let library = profile["cpu_products"].as_str().expect("a library").to_string();
    let calls = &profile["cpu_product_calls"];
    ProductsRun {
        losses,
        library,
        openblas_calls: as_u64(&calls["openblas"]),
        faer_calls: as_u64(&calls["faer"]),
        optimus_calls: as_u64(&calls["optimus"]),
    }
}

#[test]
fn our_avx2_kernel_trains_as_faer_does_with_the_same_bits_on_any_pool_size() {
    let ours = losses_with_products_on("1x1", Some("optimus"), &[], Some(2));
    if !ours.library.starts_with("optimus AVX2") {
        // A CPU without AVX2 and FMA: the choice falls back to the other libraries.
        assert_eq!(ours.optimus_calls, 0, "{}", ours.library);
        return;
    }
    assert!(ours.optimus_calls > 0 && ours.openblas_calls == 0, "{} / {}", ours.optimus_calls, ours.openblas_calls);
    let faer = losses_with_products_on("1x1", Some("faer"), &[], Some(2));
    assert_eq!(ours.losses.len(), 3);
    for (a, b) in faer.losses.iter().zip(&ours.losses) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "faer {:?} against ours {:?}", faer.losses, ours.losses);
    }
    // Products split over two workers give the bits of one worker's whole products.
    let one_worker = losses_with_products_on("1x1", Some("optimus"), &[], Some(1));
    assert_eq!(ours.losses, one_worker.losses, "2 pool threads against 1");
    // On a mesh too, and the bf16 emulation's products stay in faer.
    let mesh = losses_with_products_on("2x2", Some("optimus"), &[], Some(2));
    assert!(mesh.optimus_calls > 0);
    let bf16 = losses_with_products_on("2x2", Some("optimus"), &["--precision", "bf16"], Some(2));
    assert_eq!(bf16.optimus_calls, 0, "bf16 products in our kernel");
}

/// On a CPU whose widest vectors are AVX2 (here the cap) with OpenBLAS, the default runs every product
/// of six rows or more in our kernel (all of a training run's linears), OpenBLAS only the others; it
/// trains as faer does, and gives the same bits again.
#[test]
fn on_avx2_our_kernel_runs_the_linears_beside_openblas_and_trains_as_faer_does() {
    let mixed = losses_with_products_env("2x2", None, &[], (Some(2), Some("avx2")));
    if !mixed.library.contains(" and optimus AVX2") {
        // No OpenBLAS, or no AVX2 and FMA: one library (or faer) runs every product.
        assert!(mixed.optimus_calls == 0 || mixed.openblas_calls == 0, "{}", mixed.library);
        return;
    }
    assert!(mixed.library.starts_with("OpenBLAS"), "{}", mixed.library);
    assert!(mixed.optimus_calls > 0 && mixed.openblas_calls == 0, "{} / {}", mixed.optimus_calls, mixed.openblas_calls);
    let faer = losses_with_products_env("2x2", Some("faer"), &[], (Some(2), Some("avx2")));
    for (a, b) in faer.losses.iter().zip(&mixed.losses) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "faer {:?} against {:?}", faer.losses, mixed.losses);
    }
    let again = losses_with_products_env("2x2", None, &[], (Some(2), Some("avx2")));
    assert_eq!(mixed.losses, again.losses, "the same pool size gives the same bits");
}

#[test]
fn faer_and_the_machines_openblas_train_alike_and_the_profile_names_which_ran() {
    let faer = losses_with_products(Some("faer"), &[]);
    assert_eq!((faer.library.as_str(), faer.openblas_calls), ("faer", 0));
    assert!(faer.faer_calls > 0);
    let default = losses_with_products(None, &[]);
    assert_eq!(faer.losses.len(), 3);
    for (a, b) in faer.losses.iter().zip(&default.losses) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "faer {:?} against {:?}", faer.losses, default.losses);
    }
    // Each sequential product is counted once, in the library that ran it: the same run splits its
    // products alike whatever the library, so the calls add up to faer's.
    assert_eq!(
        default.openblas_calls + default.faer_calls + default.optimus_calls,
        faer.faer_calls,
        "{} calls ({} OpenBLAS, {} ours, {} faer) against faer's {}",
        default.library,
        default.openblas_calls,
        default.optimus_calls,
        default.faer_calls,
        faer.faer_calls
    );
    if default.library.starts_with("OpenBLAS") {
        // The linears' products ran in OpenBLAS; attention's stay in faer.
        assert!(
            default.openblas_calls > 0 && default.faer_calls > 0,
            "{} / {}",
            default.openblas_calls,
            default.faer_calls
        );
        // The bf16 emulation's products are faer's alone.
        let bf16 = losses_with_products(None, &["--precision", "bf16"]);
        assert_eq!(bf16.openblas_calls, 0, "bf16 products in OpenBLAS");
    } else if default.library.starts_with("optimus AVX2") {
        // A CPU whose widest vectors are AVX2: the linears' products ran in our kernel.
        assert!(default.optimus_calls > 0 && default.faer_calls > 0 && default.openblas_calls == 0);
        let bf16 = losses_with_products(None, &["--precision", "bf16"]);
        assert_eq!(bf16.optimus_calls, 0, "bf16 products in our kernel");
    } else {
        assert_eq!((default.library.as_str(), default.openblas_calls), ("faer", 0));
    }
    // A library that cannot be loaded (a missing path, or a misspelt `openblas` read as one) is a usage
    // error before any work, as a bad `OPTIMUS_CPU_ISA` is: the run it asked for cannot be had.
    for named in ["/nonexistent/libopenblas.so", "openblas"] {
        let out = Command::new(env!("CARGO_BIN_EXE_optimusc"))
            .args(["run", "examples/tiny.opt", "--steps", "1", "--profile"])
            .env("OPTIMUS_BLAS", named)
            .output()
            .expect("optimusc runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.starts_with(&format!("error: OPTIMUS_BLAS={named}: cannot load it"))
                && stderr.contains("it takes `faer`, `optimus` or the path of an OpenBLAS (CBLAS) library")
                && !stderr.contains("trained"),
            "{stderr}"
        );
    }
}

/// Per-step losses and the saved final weights of `run` on `mesh` with `OPTIMUS_DEVICE_KERNELS=mode`
/// (`default`: unset).
fn losses_and_weights_with_device_kernels(mode: &str, mesh: &str, strategy: &str) -> (String, Vec<u8>) {
    losses_and_weights_with(mode, mesh, strategy, None)
}

/// As [`losses_and_weights_with_device_kernels`], with `OPTIMUS_PIN_DEVICES` set to `pin` (unset: `None`).
fn losses_and_weights_with(mode: &str, mesh: &str, strategy: &str, pin: Option<&str>) -> (String, Vec<u8>) {
    let weights = scratch(&format!("{mode}-{mesh}-{strategy}-{}.safetensors", pin.unwrap_or("default")));
    let weights_arg = weights.to_string_lossy().into_owned();
    let mut command = Command::new(env!("CARGO_BIN_EXE_optimusc"));
    command.args(["run", "examples/gpt2.opt", "--mesh", mesh, "--strategy", strategy, "--steps", "3", "--json"]);
    command.args(["--set", "layers=2", "--set", "hidden=64", "--set", "heads=4", "--set", "vocab=512"]);
    command.args(["--set", "seq=64", "--set", "context=64", "--set", "batch=8", "--save-weights", &weights_arg]);
    if mode == "default" {
        command.env_remove("OPTIMUS_DEVICE_KERNELS");
    } else {
        command.env("OPTIMUS_DEVICE_KERNELS", mode);
    }
    match pin {
        Some(pin) => command.env("OPTIMUS_PIN_DEVICES", pin),
        None => command.env_remove("OPTIMUS_PIN_DEVICES"),
    };
    let out = command.output().expect("optimusc runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let losses: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|r| r.get("loss").map(Value::to_string))
        .collect();
    assert_eq!(losses.len(), 3, "{losses:?}");
    (losses.join(" "), std::fs::read(&weights).expect("the saved weights"))
}

#[test]
fn device_threads_running_their_own_kernels_compute_the_pools_bits() {
    for (mesh, strategy) in [("2x2", "optimus"), ("1x4", "megatron"), ("4x4", "optimus")] {
        let pool = losses_and_weights_with_device_kernels("pool", mesh, strategy);
        let inline = losses_and_weights_with_device_kernels("inline", mesh, strategy);
        assert_eq!(pool.0, inline.0, "losses on {strategy} {mesh}");
        assert!(pool.1 == inline.1, "final weights on {strategy} {mesh} differ");
    }
    // Device threads that run their own kernels are pinned to cores where the mesh has a device a core
    // or more (4x4 here on up to 16 cores): the same bits as left to the operating system.
    let pinned = losses_and_weights_with("inline", "4x4", "optimus", None);
    let unpinned = losses_and_weights_with("inline", "4x4", "optimus", Some("off"));
    assert_eq!(pinned.0, unpinned.0, "losses on optimus 4x4, pinned");
    assert!(pinned.1 == unpinned.1, "final weights on optimus 4x4 pinned and not differ");
    // One device runs its whole program on a pool worker by default: the same bits as handing over.
    let pool = losses_and_weights_with_device_kernels("pool", "1x1", "none");
    let on_pool = losses_and_weights_with_device_kernels("default", "1x1", "none");
    assert_eq!(pool.0, on_pool.0, "losses on 1x1");
    assert!(pool.1 == on_pool.1, "final weights on 1x1 differ");
}

/// The profile record of a 1x1 run of a small GPT-2 under the machine's default products, with these
/// environment variables set (and `OPTIMUS_BLAS`, `OPTIMUS_CPU_ISA` and `OPENBLAS_CORETYPE` otherwise unset).
fn profile_with_env(vars: &[(&str, &str)]) -> Value {
    let mut command = Command::new(env!("CARGO_BIN_EXE_optimusc"));
    for variable in ["OPTIMUS_BLAS", "OPTIMUS_CPU_ISA", "OPENBLAS_CORETYPE"] {
        command.env_remove(variable);
    }
    command.envs(vars.iter().copied());
    command.args(["run", "examples/gpt2.opt", "--steps", "2", "--profile", "--json"]);
    command.args(["--set", "layers=1", "--set", "hidden=64", "--set", "heads=4", "--set", "vocab=512"]);
    command.args(["--set", "seq=32", "--set", "context=32", "--set", "batch=8"]);
    let out = command.output().expect("optimusc runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let records: Vec<Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("JSON")).collect();
    records.last().expect("a profile record")["profile"].clone()
}

/// An OpenBLAS that does not know its CPU falls back to SSE3 kernels (Prescott), at a quarter of the
/// speed on an AVX-512 Xeon: the run leaves such a library aside and says why, and by default asks
/// OpenBLAS for kernels as wide as the CPU's.
#[test]
fn an_openblas_narrower_than_the_cpu_is_left_aside_and_by_default_it_runs_kernels_of_the_cpus_width() {
    let narrowed = profile_with_env(&[("OPENBLAS_CORETYPE", "Prescott")]);
    let library = narrowed["cpu_products"].as_str().expect("a library");
    let vectors = narrowed["peak_isa"].as_str().expect("the peak's instructions");
    let wide_cpu = vectors.starts_with("AVX");
    match narrowed["cpu_products_left_aside"].as_str() {
        Some(why) => {
            assert!(wide_cpu, "left aside on a CPU without AVX2: {why}");
            assert!(
                why.contains("its Prescott kernels are narrower than the instructions of this CPU's kernels"),
                "{why}"
            );
            assert!(!library.starts_with("OpenBLAS"), "{library}");
            assert_eq!(as_u64(&narrowed["cpu_product_calls"]["openblas"]), 0);
        }
        // No OpenBLAS on the machine, or a CPU no wider than SSE3 (where Prescott's kernels fit).
        None => assert!(!wide_cpu || !library.contains("Prescott"), "{library} on {vectors}"),
    }
    let default = profile_with_env(&[]);
    let library = default["cpu_products"].as_str().expect("a library");
    assert!(default["cpu_products_left_aside"].is_null(), "{default}");
    if library.starts_with("OpenBLAS") && vectors.starts_with("AVX-512") {
        assert!(library.contains("SkylakeX"), "{library}");
    }
}
