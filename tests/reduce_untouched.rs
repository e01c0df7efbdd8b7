//! A reduce leaves its result untouched on the members that are not its root; the executor clears that
//! buffer only where something may read it before a write fills it. On a SUMMA plan nothing does (each
//! member is the root of one of the q reduces into the same buffer); a read placed in between does.

use optimus::plan::{CollectiveKind, Coords, Instr, Mesh, Mode, Plan, Strategy};
use optimus::runtime::exec::untouched_result_may_be_read;

fn tiny_plan(mesh: Mesh) -> Plan {
    let source = include_str!("../examples/tiny.opt");
    let checked = optimus::front::check_source(source, &[]);
    let Some(model) = checked.model else { panic!("tiny.opt checks") };
    let target = optimus::shard::Target::plain(mesh, Strategy::Optimus, Mode::Train);
    optimus::shard::compile(&model, "tiny", source, target).unwrap_or_else(|e| panic!("{e:?}"))
}

/// Every (reduce, device that is not its root) of the plan where the reduce's receive buffer holds no
/// value yet on that device (written since its last release), with that buffer.
fn untouched_results(plan: &Plan) -> Vec<(usize, Coords, optimus::plan::BufferId)> {
    let mut found = Vec::new();
    for at in (0..plan.mesh.devices()).map(|r| plan.mesh.coords_of(r)) {
        let mut written = std::collections::HashSet::new();
        for (k, instr) in plan.program.iter().enumerate() {
            match instr {
                Instr::Collective { collective: c, .. } if c.kind == CollectiveKind::Reduce => {
                    if c.group.member_index(at, plan.mesh) == c.root.unwrap_or(0) {
                        written.insert(c.recv);
                    } else if !written.contains(&c.recv) {
                        found.push((k, at, c.recv));
                    }
                }
                Instr::Collective { collective: c, .. } => _ = written.insert(c.recv),
                Instr::Kernel { output, .. } => _ = written.insert(*output),
                Instr::Free { buffer } => _ = written.remove(buffer),
                Instr::Wait { .. } => {}
            }
        }
    }
    found
}

#[test]
fn no_summa_reduce_result_is_read_before_its_root_writes_it() {
    for mesh in [Mesh::new(2, 2), Mesh::new(4, 4)] {
        let plan = tiny_plan(mesh);
        let untouched = untouched_results(&plan);
        assert!(!untouched.is_empty(), "{mesh:?}: the plan reduces");
        for (k, at, recv) in untouched {
            assert!(!untouched_result_may_be_read(&plan, recv, k, at), "{mesh:?}: reduce {k} on {at:?}");
        }
    }
}

#[test]
fn a_read_between_the_reduces_needs_the_untouched_result() {
    let mut plan = tiny_plan(Mesh::new(2, 2));
    let (k, at, recv) = untouched_results(&plan)[0];
    let Some(reader) = plan.program.iter().position(|i| matches!(i, Instr::Kernel { .. })) else { panic!("a kernel") };
    let Instr::Kernel { kernel, origin, reason, .. } = plan.program[reader].clone() else { unreachable!() };
    let scratch = plan.buffers.iter().map(|b| b.id).find(|&b| b != recv).unwrap_or(recv);
    plan.program.insert(k + 1, Instr::Kernel { kernel, inputs: vec![recv], output: scratch, origin, reason });
    assert!(untouched_result_may_be_read(&plan, recv, k, at));
    // Released right after instead: nothing reads it.
    plan.program[k + 1] = Instr::Free { buffer: recv };
    assert!(!untouched_result_may_be_read(&plan, recv, k, at));
}
