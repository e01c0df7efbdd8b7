//! `silu(x)`: a model whose MLP uses it compiles on every strategy, and each sharded plan computes what
//! one device computes (outputs, every gradient and the updated weights), as `optimusc verify` checks.

mod common;

use std::process::Command;

#[test]
fn a_silu_mlp_verifies_on_every_strategy() {
    let tiny = std::fs::read_to_string("examples/tiny.opt").expect("example");
    let text = tiny.replace("gelu(c_fc(x), approx: \"tanh\")", "silu(c_fc(x))");
    assert!(text.contains("silu(c_fc(x))"), "the edit applies");
    let dir = common::process_dir("silu");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let model = dir.join("silu.opt");
    std::fs::write(&model, text).expect("write model");
    for mesh in [&["--mesh", "2x2"][..], &["--mesh", "4x4"], &["--mesh", "1x4", "--strategy", "megatron"]] {
        let out = Command::new(env!("CARGO_BIN_EXE_optimusc"))
            .arg("verify")
            .arg(&model)
            .args(mesh)
            .output()
            .expect("optimusc runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{mesh:?}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        assert!(stdout.contains("verified"), "{mesh:?}: {stdout}");
    }
}
