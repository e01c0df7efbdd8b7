//! The simulator: collective times against hand-computed alpha-beta values, placements, memory
//! figures against `inspect`'s, max batch monotone in device memory, bad hardware files, and
//! `simulate` / `--compare` / `--sweep` on every example.

mod common;

use optimus::cost::collective::{ceil_log2, ring_time, tree_time};
use optimus::cost::flows::{GroupLayout, collective_seconds};
use optimus::cost::search::{self, Source};
use optimus::cost::{Algorithm, Hardware, LinkKind, NodeMap, Options, RankPlacement, collective_time, simulate};
use optimus::elab::Override;
use optimus::plan::{CollectiveKind, Coords, Group, Mesh, Mode, Plan, Strategy};
use optimus::shard::Target;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A profile with round numbers: 10 GB/s and 1 us inside a node of 4; a 8 GB/s NIC per node (2 GB/s
/// per GPU) and 5 us between nodes.
fn profile(memory_gb: f64) -> Hardware {
    let text = format!(
        r#"
name = "test"
[device]
name = "test gpu"
memory_gb = {memory_gb}
memory_bandwidth_gb_s = 100.0
achievable_bandwidth = 1.0
achievable_compute = 1.0
[device.peak_tflops]
f32 = 1.0
[intra_node]
gpus_per_node = 4
bandwidth_gb_s = 10.0
latency_us = 1.0
[inter_node]
nic_bandwidth_gb_s = 8.0
latency_us = 5.0
"#
    );
    match Hardware::parse(&text, "test") {
        Ok(hw) => hw,
        Err(e) => panic!("{e}"),
    }
}

fn close(actual: f64, expected: f64) {
    assert!((actual - expected).abs() <= 1e-12 + 1e-9 * expected.abs(), "{actual} != {expected}");
}

const MB: f64 = 1e6;

#[test]
fn ring_times_match_the_alpha_beta_formulas() {
    let hw = profile(16.0);
    let (intra, inter) = (hw.intra_link(), hw.inter_link());
    // Intra-node, p = 4, 1 MB: all-reduce 2*3*1us + 2*3/4*1e6/10e9.
    close(ring_time(CollectiveKind::AllReduce, 4, MB, intra), 6e-6 + 1.5e-4);
    close(ring_time(CollectiveKind::AllGather, 4, MB, intra), 3e-6 + 0.75e-4);
    close(ring_time(CollectiveKind::ReduceScatter, 4, MB, intra), 3e-6 + 0.75e-4);
    close(ring_time(CollectiveKind::Broadcast, 4, MB, intra), 3e-6 + 1e-4);
    close(ring_time(CollectiveKind::Reduce, 4, MB, intra), 3e-6 + 1e-4);
    // Inter-node, p = 8: 2 GB/s per GPU, 5 us. All-reduce 2*7*5us + 2*7/8*1e6/2e9.
    close(inter.bandwidth, 2e9);
    close(ring_time(CollectiveKind::AllReduce, 8, MB, inter), 70e-6 + 8.75e-4);
    close(ring_time(CollectiveKind::Broadcast, 8, MB, inter), 35e-6 + 5e-4);
}

#[test]
fn tree_times_match_the_alpha_beta_formulas() {
    let hw = profile(16.0);
    let inter = hw.inter_link();
    assert_eq!((ceil_log2(1), ceil_log2(2), ceil_log2(5), ceil_log2(8)), (0, 1, 3, 3));
    // p = 8: 3 rounds of (5 us + 1e6 / 2e9).
    close(tree_time(CollectiveKind::Broadcast, 8, MB, inter), 3.0 * (5e-6 + 5e-4));
    close(tree_time(CollectiveKind::AllReduce, 8, MB, inter), 6.0 * (5e-6 + 5e-4));
    close(tree_time(CollectiveKind::AllGather, 8, MB, inter), 15e-6 + 7.0 / 8.0 * 5e-4);
    // Small messages: the tree wins and auto takes it; large ones: the ring.
    let small = collective_time(CollectiveKind::AllReduce, 8, 8.0, inter, Algorithm::Auto);
    close(small, tree_time(CollectiveKind::AllReduce, 8, 8.0, inter));
    let large = collective_time(CollectiveKind::AllReduce, 8, 1e9, inter, Algorithm::Auto);
    close(large, ring_time(CollectiveKind::AllReduce, 8, 1e9, inter));
    close(collective_time(CollectiveKind::AllReduce, 1, 1e9, inter, Algorithm::Ring), 0.0);
}

#[test]
fn placements_decide_which_link_a_group_crosses() {
    let mesh = Mesh::new(4, 4);
    let row_major = NodeMap::new(mesh, 4, RankPlacement::RowMajor);
    assert_eq!(row_major.link_kind(Group::Row), LinkKind::IntraNode);
    assert_eq!(row_major.link_kind(Group::Column), LinkKind::InterNode);
    let blocks = NodeMap::new(mesh, 4, RankPlacement::Blocks);
    assert_eq!(blocks.block, Some((2, 2)));
    assert_eq!(
        (
            blocks.node_of(Coords::new(0, 0, 0)),
            blocks.node_of(Coords::new(1, 1, 0)),
            blocks.node_of(Coords::new(0, 2, 0)),
            blocks.node_of(Coords::new(2, 0, 0))
        ),
        (0, 0, 1, 2)
    );
    assert_eq!(blocks.link_kind(Group::Row), LinkKind::InterNode);
    assert_eq!(blocks.link_kind(Group::Column), LinkKind::InterNode);
    // A whole mesh on one node: every group is intra-node whatever the placement.
    let small = NodeMap::new(Mesh::new(2, 2), 4, RankPlacement::Blocks);
    assert_eq!(small.link_kind(Group::World), LinkKind::IntraNode);
    assert_eq!(small.link_kind(Group::Column), LinkKind::IntraNode);
    // 8 per node on 8x8: blocks of 2x4.
    assert_eq!(NodeMap::new(Mesh::new(8, 8), 8, RankPlacement::Blocks).block, Some((2, 4)));
    // No block of 4 devices tiles a 1x6 mesh: row-major, with a note.
    let odd = NodeMap::new(Mesh::new(1, 6), 4, RankPlacement::Blocks);
    assert_eq!(odd.block, None);
    assert!(odd.note.is_some());
}

/// Devices in a group of the 4x4 mesh: a row or a column has 4, the world (the gradient norm's) 16.
fn group_size(group: &str) -> u64 {
    match group {
        "world" => 16,
        "mirror" => 2,
        _ => 4,
    }
}

#[test]
fn group_times_in_a_plan_use_their_links() {
    // A 4x4 optimus plan with 4 per node. Row-major: row groups intra-node, column groups inter-node.
    let plan = compile_example("tiny.opt", &[], Target::plain(Mesh::new(4, 4), Strategy::Optimus, Mode::Train));
    let hw = profile(16.0);
    let report = optimus::plan::report::report(&plan);
    // Blocks of 2x2 per node: every row and column group crosses nodes.
    for (placement, row_intra) in [(RankPlacement::RowMajor, true), (RankPlacement::Blocks, false)] {
        let options = Options { placement, algorithm: Some(Algorithm::Ring), overlap: false, ..Options::default() };
        let sim = simulate(&plan, &hw, &options);
        assert!(!sim.communication.is_empty());
        for entry in &sim.communication {
            let intra = entry.group == "row" && row_intra;
            assert_eq!(entry.link, if intra { "intra-node" } else { "inter-node" }, "{placement:?} {entry:?}");
            // Row-major: a node holds a row, so its NIC carries the 4 column groups' ring flows, 2 GB/s
            // each of the 8 GB/s. Blocks of 2x2: 2 groups of each kind cross each NIC, 4 GB/s each.
            // The world is one group: one flow per NIC. The tied table's transposes pair (i, j) with
            // (j, i): row-major, a node's NIC carries its 3 devices off the diagonal; blocks of 2x2,
            // the 4 devices of a block off the diagonal (those on it keep their pairs inside).
            let link = if intra {
                hw.intra_link()
            } else {
                let flows = match (entry.group.as_str(), placement) {
                    ("world", _) => 1.0,
                    ("mirror", RankPlacement::RowMajor) => 3.0,
                    ("mirror", _) => 4.0,
                    (_, RankPlacement::RowMajor) => 4.0,
                    _ => 2.0,
                };
                optimus::cost::Link { bandwidth: 8e9 / flows, latency: 5e-6 }
            };
            let expected: f64 = report
                .communication
                .iter()
                .filter(|c| c.group == entry.group && c.kind == entry.kind)
                .map(|c| ring_time(kind_of(&c.kind), group_size(&c.group), c.bytes as f64, link))
                .sum();
            close(entry.time_s, expected);
            close(entry.exposed_s, entry.time_s);
        }
    }
    let options = Options { algorithm: Some(Algorithm::Ring), overlap: false, ..Options::default() };
    let sim = simulate(&plan, &hw, &options);
    close(sim.step_time_s, sim.compute_s + sim.communication_s);
    // With double buffering, some broadcast time hides and the step gets no slower.
    let overlapped = simulate(&plan, &hw, &Options { overlap: true, ..options });
    assert!(overlapped.hidden_communication_s > 0.0);
    assert!(overlapped.step_time_s <= sim.step_time_s);
    close(overlapped.exposed_communication_s + overlapped.hidden_communication_s, overlapped.communication_s);
}

fn kind_of(name: &str) -> CollectiveKind {
    match name {
        "broadcast" => CollectiveKind::Broadcast,
        "reduce" => CollectiveKind::Reduce,
        "all_reduce" => CollectiveKind::AllReduce,
        "all_gather" => CollectiveKind::AllGather,
        "transpose" => CollectiveKind::Transpose,
        _ => CollectiveKind::ReduceScatter,
    }
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples")
}

fn overrides(pairs: &[(&str, &str)]) -> Vec<Override> {
    pairs.iter().map(|(n, v)| Override { name: n.to_string(), value: v.to_string() }).collect()
}

fn compile_example(file: &str, set: &[(&str, &str)], target: Target) -> Plan {
    let text = std::fs::read_to_string(examples().join(file)).unwrap_or_default();
    let set = overrides(set);
    let source = Source { name: file, text: &text, overrides: &set };
    match source.compile(target, &[]) {
        Ok(plan) => plan,
        Err(e) => panic!("{file}: {e}"),
    }
}

#[test]
fn max_batch_is_monotone_in_device_memory() {
    let text = std::fs::read_to_string(examples().join("tiny.opt")).unwrap_or_default();
    let source = Source { name: "tiny.opt", text: &text, overrides: &[] };
    let target = Target::plain(Mesh::new(2, 2), Strategy::Optimus, Mode::Train);
    let mut last = 0;
    for mb in [0.05, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0] {
        let hw = profile(mb / 1000.0);
        let found = search::max_batch(&source, target, hw.memory_bytes());
        assert!(found.max_batch >= last, "{mb} MB: {} < {last}", found.max_batch);
        assert_eq!(found.max_batch % 2, 0);
        if found.max_batch > 0 {
            let plan = compile_example("tiny.opt", &[("batch", &found.max_batch.to_string())], target);
            assert!(plan.memory.peak_bytes <= hw.memory_bytes());
            let next = (found.max_batch + 2).to_string();
            let bigger = compile_example("tiny.opt", &[("batch", &next)], target);
            assert!(bigger.memory.peak_bytes > hw.memory_bytes());
        }
        last = found.max_batch;
    }
    assert!(last > 0);
}

#[test]
fn bad_hardware_files_give_clear_errors() {
    let good = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("hardware/dgx-a100.toml"))
        .unwrap_or_default();
    assert!(Hardware::parse(&good, "dgx-a100").is_ok());
    let cases = [
        (good.replace("memory_gb = 80.0", "memory_gb = -1.0"), "device.memory_gb"),
        // Positive but no device's: reports showed 1e300 GB as 16777216 TiB and 1e-300 as "0 B (inf%)".
        (good.replace("memory_gb = 80.0", "memory_gb = 1e300"), "`device.memory_gb` is 1e300: give a device memory"),
        (good.replace("memory_gb = 80.0", "memory_gb = 1e-300"), "`device.memory_gb` is 1e-300"),
        (good.replace("achievable_compute = 0.7", "achievable_compute = 1.5"), "achievable_compute"),
        (good.replace("latency_us = 3.0", "latency_us = 3.0\nspeed = 9"), "speed"),
        (good.replace("gpus_per_node = 8", ""), "gpus_per_node"),
        ("not toml [".to_string(), "invalid hardware profile"),
        // Positive or zero, but past any machine: step times came out infinite, NaN, or 300 digits long.
        (good.replace("f32 = 19.5", "f32 = 5e-324"), "`device.peak_tflops.f32` must be a positive number from 1e-6"),
        (good.replace("bandwidth_gb_s = 240.0", "bandwidth_gb_s = 1e300"), "found 1e300"),
        (good.replace("latency_us = 3.0", "latency_us = 1e300"), "`intra_node.latency_us` must be from 0 to 1e9"),
        (good.replace("kernel_launch_us = 5.0", "kernel_launch_us = 2e9"), "found 2e9"),
    ];
    for (text, needle) in cases {
        match Hardware::parse(&text, "bad.toml") {
            Ok(_) => panic!("accepted a bad profile (expected an error about {needle})"),
            Err(e) => {
                let e = e.to_string();
                assert!(e.contains(needle) && e.contains("bad.toml"), "{e}");
            }
        }
    }
    let unknown = Hardware::load("no-such-cluster").err().map(|e| e.to_string()).unwrap_or_default();
    assert!(unknown.contains("frontera-rtx5000"), "{unknown}");
    for name in ["frontera-rtx5000", "dgx-a100", "dgx-h100"] {
        assert!(Hardware::load(name).is_ok(), "{name}");
    }
}

fn optimusc(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output();
    match out {
        Ok(o) => (
            o.status.success(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        ),
        Err(e) => panic!("cannot run optimusc: {e}"),
    }
}

fn json(text: &str) -> serde_json::Value {
    match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => panic!("bad JSON ({e}): {text}"),
    }
}

const SMALL: [&str; 12] = [
    "--set",
    "layers=1",
    "--set",
    "hidden=64",
    "--set",
    "heads=4",
    "--set",
    "seq=16",
    "--set",
    "context=16",
    "--set",
    "batch=4",
];

/// A scratch folder of this test (`tag`), `examples/gpt2.opt`, and the path of a plan in the folder.
fn scratch_plan_for_gpt2(tag: &str) -> (PathBuf, String, String) {
    let dir = common::process_dir("simulate").join(tag);
    let _ = std::fs::create_dir_all(&dir);
    let plan = dir.join("plan.json").to_string_lossy().into_owned();
    (dir, examples().join("gpt2.opt").to_string_lossy().into_owned(), plan)
}

#[test]
fn memory_figures_are_inspects() {
    let (dir, model, plan_s) = scratch_plan_for_gpt2("memory");
    for strategy in ["optimus", "megatron"] {
        let mesh = if strategy == "optimus" { "2x2" } else { "1x4" };
        let mut compile = vec!["compile", &model, "--mesh", mesh, "--strategy", strategy, "-o", &plan_s];
        compile.extend(SMALL);
        assert!(optimusc(&compile).0);
        let (ok, inspect, _) = optimusc(&["inspect", &plan_s, "--json"]);
        assert!(ok);
        let (ok, sim, err) = optimusc(&["simulate", &plan_s, "--hardware", "dgx-a100", "--json"]);
        assert!(ok, "{err}");
        let (inspect, sim) = (json(&inspect), json(&sim));
        assert_eq!(inspect["memory"]["peak_bytes"], sim["memory"]["peak_bytes_per_device"]);
        assert!(sim["memory"]["peak_bytes_per_device"].as_u64().unwrap_or(0) > 0);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn simulate_and_compare_run_on_every_example() {
    let mut count = 0;
    for entry in std::fs::read_dir(examples()).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "opt") {
            continue;
        }
        count += 1;
        let model = path.to_string_lossy().into_owned();
        let mut args = vec!["simulate", model.as_str(), "--mesh", "2x2", "--hardware", "frontera-rtx5000"];
        args.extend(SMALL);
        // Grouped-query models: as many key/value heads as query heads, so both strategies split them 4 ways.
        if std::fs::read_to_string(&path).is_ok_and(|text| text.contains("kv_heads")) {
            args.extend(["--set", "kv_heads=4"]);
        }
        let (ok, text, err) = optimusc(&args);
        assert!(ok && text.contains("step time"), "{model}: {err}");
        args.extend(["--compare", "--max-batch", "--json", "--placement", "blocks"]);
        let (ok, text, err) = optimusc(&args);
        assert!(ok, "{model}: {err}");
        let v = json(&text);
        for strategy in ["optimus", "megatron"] {
            assert!(v[strategy]["step_time_s"].as_f64().is_some_and(|t| t > 0.0), "{model}: {text}");
            assert!(v[strategy]["peak_bytes_per_device"].as_u64().is_some(), "{model}: {text}");
            assert!(v[strategy]["max_batch"].as_u64().is_some_and(|b| b > 0), "{model}: {text}");
        }
        assert!(v["speedup"].as_f64().is_some() && v["max_batch_ratio"].as_f64().is_some(), "{model}: {text}");
    }
    assert!(count >= 5);
}

#[test]
fn sweep_marks_points_that_do_not_divide_as_infeasible() {
    let model = examples().join("tiny.opt").to_string_lossy().into_owned();
    let args = ["simulate", &model, "--hardware", "dgx-h100", "--sweep", "--json"];
    let (ok, text, err) = optimusc(&args);
    assert!(ok, "{err}");
    let points = json(&text);
    let points = points.as_array().cloned().unwrap_or_default();
    assert_eq!(points.len(), 16);
    // tiny has 8 heads: megatron cannot split them 16 ways or more.
    let infeasible = points.iter().filter(|p| p["infeasible"].is_string()).count();
    assert!(infeasible >= 4, "{text}");
    assert!(points.iter().any(|p| p["efficiency"].as_f64() == Some(1.0)));
    // A model with errors shows them, with their spans, as without --sweep (it was said to have no batch).
    for search in ["--sweep", "--compare"] {
        let (ok, _, err) = optimusc(&["simulate", &model, "--hardware", "dgx-h100", search, "--set", "heads=7"]);
        assert!(!ok && err.contains("error[E0203]") && !err.contains("no integer `batch`"), "{search}: {err}");
    }
}

#[test]
fn unknown_hardware_is_a_usage_error() {
    let model = examples().join("tiny.opt").to_string_lossy().into_owned();
    let out = Command::new(env!("CARGO_BIN_EXE_optimusc")).args(["simulate", &model, "--hardware", "nope"]).output();
    let code = out.ok().and_then(|o| o.status.code());
    assert_eq!(code, Some(2));
}

/// `--no-overlap` exposes the data-parallel gradient sums as well as SUMMA's broadcasts, and
/// contradicting `--overlap` is a usage error rather than one flag silently winning.
#[test]
fn no_overlap_exposes_the_gradient_sums_and_conflicts_with_overlap() {
    let model = examples().join("gpt2.opt").to_string_lossy().into_owned();
    let base = ["simulate", &model, "--mesh", "2x2x2", "--hardware", "dgx-a100", "--json"];
    let data_sums = |extra: &[&str]| {
        let (ok, out, err) = optimusc(&[&base[..], extra].concat());
        assert!(ok, "{err}");
        let sim = json(&out);
        let rows = sim["communication"].as_array().cloned().unwrap_or_default();
        let row = rows.iter().find(|r| r["group"] == "data" && r["kind"] == "all_reduce").cloned();
        let row = row.unwrap_or_else(|| panic!("no data all_reduce row in {sim}"));
        (row["time_s"].as_f64().unwrap_or(f64::NAN), row["exposed_s"].as_f64().unwrap_or(f64::NAN))
    };
    let (time, exposed) = data_sums(&[]);
    assert!(exposed < 0.5 * time, "overlapped: {exposed} of {time} s exposed");
    let (time, exposed) = data_sums(&["--no-overlap"]);
    assert!(time > 0.0 && exposed == time, "--no-overlap: {exposed} of {time} s exposed");
    let out = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .args([&base[..], &["--overlap", "--no-overlap"]].concat())
        .output();
    let out = out.unwrap_or_else(|e| panic!("cannot run optimusc: {e}"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("cannot be used with"), "{stderr}");
}

#[test]
fn rings_share_each_nic_among_the_groups_whose_flows_cross_it() {
    let hw = profile(16.0);
    let mesh = Mesh::new(8, 8);
    let layout = |map: &NodeMap, g| GroupLayout::of(map, g);
    let row_major = NodeMap::new(mesh, 4, RankPlacement::RowMajor);
    let blocks = NodeMap::new(mesh, 4, RankPlacement::Blocks);
    let megatron = NodeMap::new(Mesh::new(1, 64), 4, RankPlacement::RowMajor);
    let per_node = |map: &NodeMap, g| layout(map, g).groups_per_node();
    assert_eq!((per_node(&row_major, Group::Row), per_node(&row_major, Group::Column)), (1, 4));
    assert_eq!((per_node(&blocks, Group::Row), per_node(&blocks, Group::Column)), (2, 2));
    assert_eq!(per_node(&megatron, Group::Row), 1);
    // Ring broadcast of 1 MB over 8: 7 steps at the inter-node 5 us, and the busier of the member's
    // own 10 GB/s link and its share of the 8 GB/s NIC with the other groups crossing it.
    let ring =
        |map: &NodeMap, g| collective_seconds(CollectiveKind::Broadcast, &layout(map, g), MB, &hw, Algorithm::Ring);
    close(ring(&row_major, Group::Column).1, 35e-6 + 4.0 * MB / 8e9);
    close(ring(&row_major, Group::Row).1, 35e-6 + MB / 8e9);
    close(ring(&blocks, Group::Row).1, 35e-6 + 2.0 * MB / 8e9);
    assert_eq!(ring(&row_major, Group::Row).0, LinkKind::InterNode, "a row of 8 spans two nodes of 4");
    // One 64-member all-reduce ring: one flow per NIC, 2*63/64 MB through it, but no faster than the
    // member's 10 GB/s link: 126 steps at 5 us + 2*63/64 MB / 8 GB/s.
    let all_reduce =
        |algorithm| collective_seconds(CollectiveKind::AllReduce, &layout(&megatron, Group::Row), MB, &hw, algorithm).1;
    close(all_reduce(Algorithm::Ring), 630e-6 + 2.0 * 63.0 / 64.0 * MB / 8e9);
    // Hierarchical: reduce-scatter and all-gather among the 4 of a node (2*3 steps at 1 us, 2*3/4 MB
    // at 10 GB/s), all-reduce between the 16 nodes (2*4 tree rounds at 5 us, 2*15/16 MB at 8 GB/s).
    let hierarchical = 6e-6 + 40e-6 + 1.5 * MB / 10e9 + 2.0 * 15.0 / 16.0 * MB / 8e9;
    close(all_reduce(Algorithm::Tree), hierarchical);
    close(all_reduce(Algorithm::Auto), hierarchical.min(all_reduce(Algorithm::Ring)));
    assert!(all_reduce(Algorithm::Tree) < all_reduce(Algorithm::Ring), "126 latencies cost more than 14");
}

#[test]
fn blocks_beat_row_major_for_summa_broadcasts_across_nodes() {
    // The Optimus code places 2x2 blocks per node: a row and a column broadcast then put 2 + 2 flows
    // through each NIC, against 1 + 4 for row-major (whose column groups span every node).
    let hw = profile(16.0);
    let mesh = Mesh::new(8, 8);
    let step = |placement| {
        let map = NodeMap::new(mesh, 4, placement);
        [Group::Row, Group::Column]
            .into_iter()
            .map(|g| {
                collective_seconds(CollectiveKind::Broadcast, &GroupLayout::of(&map, g), 4.0 * MB, &hw, Algorithm::Auto)
                    .1
            })
            .sum::<f64>()
    };
    assert!(
        step(RankPlacement::Blocks) < step(RankPlacement::RowMajor),
        "{} vs {}",
        step(RankPlacement::Blocks),
        step(RankPlacement::RowMajor)
    );
}

fn buffer(shape: &[u64], dtype: optimus::plan::types::DType) -> optimus::plan::Buffer {
    optimus::plan::Buffer {
        id: optimus::plan::BufferId(0),
        name: "b".to_string(),
        dtype,
        logical_shape: shape.to_vec(),
        layout: optimus::plan::layout::Layout::REPLICATED,
        shape: shape.to_vec(),
        role: optimus::plan::Role::Workspace,
    }
}

#[test]
fn kernels_cost_the_roofline() {
    use optimus::cost::step::kernel_time;
    use optimus::plan::Kernel;
    use optimus::plan::types::DType;
    // 1 TFLOP/s and 100 GB/s at full efficiency, no launch cost.
    let hw = profile(16.0);
    // A [1000, 1000] x [1000, 1000] product: 2e9 FLOPs = 2 ms; 12 MB moved = 0.12 ms. Compute-bound.
    let (a, b, c) =
        (buffer(&[1000, 1000], DType::F32), buffer(&[1000, 1000], DType::F32), buffer(&[1000, 1000], DType::F32));
    let matmul = Kernel::MatMul { transpose_a: false, transpose_b: false, accumulate: false };
    close(kernel_time(&matmul, &[&a, &b], &c, &hw), 2e-3);
    // An add of two 1e6-element f32 tensors: 1e6 FLOPs = 1 us; 12 MB at 100 GB/s = 0.12 ms. Memory-bound.
    close(kernel_time(&Kernel::Add, &[&a, &b], &c, &hw), 1.2e-4);
    // f16 has no rate of its own in this profile: the f32 rate, and half the bytes.
    let (a16, b16, c16) =
        (buffer(&[1000, 1000], DType::F16), buffer(&[1000, 1000], DType::F16), buffer(&[1000, 1000], DType::F16));
    close(kernel_time(&matmul, &[&a16, &b16], &c16, &hw), 2e-3);
    close(kernel_time(&Kernel::Add, &[&a16, &b16], &c16, &hw), 0.6e-4);
}

#[test]
fn compare_takes_any_set_of_strategies_and_marks_those_the_devices_do_not_fit() {
    let model = examples().join("tiny.opt").to_string_lossy().into_owned();
    let base = ["simulate", &model, "--hardware", "dgx-a100", "--set", "batch=16"];
    // 8 devices: no square grid for optimus; tesseract takes 2 depth layers of 2x2.
    let mut args = base.to_vec();
    args.extend(["--mesh", "2x4", "--strategy", "megatron", "--compare=optimus,tesseract,megatron,3d", "--json"]);
    let (ok, text, err) = optimusc(&args);
    assert!(ok, "{err}");
    let v = json(&text);
    assert!(v["optimus"]["infeasible"].as_str().is_some_and(|r| r.contains("not a square")), "{text}");
    assert_eq!(v["tesseract"]["mesh"], "2x2x2", "{text}");
    assert!(v["tesseract"]["step_time_s"].as_f64().is_some_and(|t| t > 0.0), "{text}");
    assert!(v["megatron"]["step_time_s"].as_f64().is_some_and(|t| t > 0.0), "{text}");
    assert_eq!(v["3d"]["mesh"], "2x2x2", "{text}");
    assert!(v["3d"]["step_time_s"].as_f64().is_some_and(|t| t > 0.0), "{text}");
    // 16 devices are no cube.
    let mut args = base.to_vec();
    args.extend(["--mesh", "4x4", "--compare=optimus,3d", "--json"]);
    let (ok, text, err) = optimusc(&args);
    assert!(ok, "{err}");
    assert!(json(&text)["3d"]["infeasible"].as_str().is_some_and(|r| r.contains("not a q x q x q cube")), "{text}");
    // The table marks the fastest and states each other's ratio to it.
    let mut args = base.to_vec();
    args.extend(["--mesh", "4x4", "--compare=tesseract,optimus"]);
    let (ok, text, err) = optimusc(&args);
    assert!(ok && text.contains("tesseract 4x2x2") && text.contains("1.00x"), "{text}{err}");
    assert!(!text.contains("speedup (megatron"), "no megatron, no megatron ratio: {text}");
    // A set of fewer than two strategies or none is a usage error; a device count nothing fits fails.
    for (compare, mesh, expected) in [
        ("--compare=optimus", "4x4", "two strategies or more"),
        ("--compare=none,optimus", "4x4", "[possible values: optimus, megatron, tesseract, 3d]"),
        ("--compare=optimus,tesseract", "1x3", "no strategy compared fits 3 devices"),
    ] {
        let mut args = base.to_vec();
        args.extend(["--mesh", mesh, "--strategy", "megatron", compare]);
        let (ok, _, err) = optimusc(&args);
        assert!(!ok && err.contains(expected), "{compare} on {mesh}: {err}");
    }
}

#[test]
fn by_kind_splits_the_step_compute_by_the_plans_kernels() {
    let (dir, model, plan_s) = scratch_plan_for_gpt2("kinds");
    for (mesh, strategy, hardware) in [("2x2", "optimus", "dgx-a100"), ("1x4", "megatron", "frontera-rtx5000")] {
        let target = [&["--mesh", mesh, "--strategy", strategy][..], &SMALL[..]].concat();
        let (ok, _, err) = optimusc(&[&["compile", &model, "-o", &plan_s][..], &target].concat());
        assert!(ok, "{err}");
        let text = std::fs::read_to_string(&plan_s).unwrap_or_default();
        let plan: optimus::plan::Plan =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("the plan reads back: {e}"));
        let args = [&["simulate", &model, "--hardware", hardware, "--by-kind", "--json"][..], &target].concat();
        let (ok, out, err) = optimusc(&args);
        assert!(ok, "{err}");
        let sim = json(&out);
        let rows = sim["by_kind"].as_array().cloned().unwrap_or_default();
        // Every kernel kind of the plan once, with its count; the times add up to the step's compute.
        let mut expected: std::collections::BTreeMap<&str, u64> = Default::default();
        for instr in &plan.program {
            if let optimus::plan::Instr::Kernel { kernel, .. } = instr {
                *expected.entry(kernel.name()).or_default() += 1;
            }
        }
        let got: std::collections::BTreeMap<&str, u64> =
            rows.iter().map(|r| (r["kind"].as_str().unwrap_or("?"), r["count"].as_u64().unwrap_or(0))).collect();
        assert_eq!(got, expected, "{mesh} {strategy}");
        let total: f64 = rows.iter().map(|r| r["step_s"].as_f64().unwrap_or(f64::NAN)).sum();
        let compute = sim["compute_s"].as_f64().unwrap_or(f64::NAN);
        assert!((total - compute).abs() <= 1e-9 * compute.max(1.0), "{total} against {compute}");
        let times: Vec<f64> = rows.iter().map(|r| r["step_s"].as_f64().unwrap_or(f64::NAN)).collect();
        assert!(times.windows(2).all(|w| w[0] >= w[1]), "the largest first: {times:?}");
        // The text gives the same table.
        let text_args = [&["simulate", &model, "--hardware", hardware, "--by-kind"][..], &target].concat();
        let (ok, text, _) = optimusc(&text_args);
        assert!(ok && text.contains("compute by kernel kind (per device per step):"), "{text}");
        assert!(rows.iter().all(|r| text.contains(r["kind"].as_str().unwrap_or("?"))), "{text}");
    }
    // It is refused beside the searches and the pipelined simulations, with a line that says so.
    for extra in [&["--sweep"][..], &["--pipeline", "2"], &["--accum", "2"]] {
        let args = [&["simulate", &model, "--hardware", "dgx-a100", "--by-kind"][..], extra].concat();
        let (ok, _, err) = optimusc(&args);
        assert!(!ok && err.contains("--by-kind"), "{extra:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--layouts paper` reaches every plan a search compiles: the optimus side of `--compare` and the
/// optimus points of `--sweep` take the paper's layouts (their steps differ from the default's), the
/// megatron ones are the same plans; `inspect` names the choice a plan records, in text and JSON.
#[test]
fn the_papers_layouts_reach_the_plans_a_search_compiles_and_inspect_names_them() {
    let model = examples().join("gpt2.opt").to_string_lossy().into_owned();
    let sets = ["layers=1", "hidden=256", "heads=4", "vocab=512", "context=64", "seq=64", "batch=8"];
    let run = |extra: &[&str]| {
        let mut args = vec!["simulate", model.as_str(), "--hardware", "dgx-a100", "--mesh", "2x2", "--json"];
        args.extend(sets.iter().flat_map(|s| ["--set", *s]));
        args.extend(extra);
        let (ok, text, err) = optimusc(&args);
        assert!(ok, "{args:?}: {err}");
        json(&text)
    };
    let step = |v: &serde_json::Value, strategy: &str| v[strategy]["step_time_s"].as_f64();
    let (auto, paper) = (run(&["--compare"]), run(&["--compare", "--layouts", "paper"]));
    assert!(step(&auto, "optimus").is_some() && step(&auto, "optimus") != step(&paper, "optimus"), "{auto} {paper}");
    assert_eq!(step(&auto, "megatron"), step(&paper, "megatron"));
    let (auto, paper) = (run(&["--sweep"]), run(&["--sweep", "--layouts", "paper"]));
    let steps = |v: &serde_json::Value, strategy: &str| -> Vec<Option<f64>> {
        let points = v.as_array().cloned().unwrap_or_default();
        points.iter().filter(|p| p["strategy"] == strategy).map(|p| p["simulation"]["step_time_s"].as_f64()).collect()
    };
    assert_ne!(steps(&auto, "optimus"), steps(&paper, "optimus"));
    assert_eq!(steps(&auto, "megatron"), steps(&paper, "megatron"));
    assert!(!steps(&auto, "megatron").is_empty());

    let dir = common::process_dir("layouts");
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    for (layouts, named) in [("paper", true), ("auto", false)] {
        let plan = dir.join(format!("{layouts}.json")).to_string_lossy().into_owned();
        let tiny = examples().join("tiny.opt").to_string_lossy().into_owned();
        let (ok, _, err) = optimusc(&["compile", &tiny, "--mesh", "2x2", "--layouts", layouts, "-o", &plan]);
        assert!(ok, "{err}");
        let (ok, text, err) = optimusc(&["inspect", &plan]);
        assert!(ok && text.contains("the paper's layouts") == named, "{layouts}: {err}{text}");
        let (ok, text, err) = optimusc(&["inspect", &plan, "--json"]);
        assert!(ok, "{err}");
        assert_eq!(json(&text)["layouts"] == "paper", named, "{layouts}: {text}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
