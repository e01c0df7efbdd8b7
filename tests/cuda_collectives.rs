//! Collectives on device pointers: the devices of a mesh sharing one GPU (a thread and a stream each)
//! give, bit for bit, what the host thread fabric gives for every collective kind, group, split and
//! element type, even when each device overwrites its send buffer right after the collective; and NCCL
//! on device buffers (one-member groups on one GPU) gives what the shared-GPU communicator gives.
//!
//! Without a CUDA driver or GPU these tests print why and pass, unless `OPTIMUS_REQUIRE_CUDA=1`; the
//! NCCL test also needs libnccl (`OPTIMUS_REQUIRE_NCCL=1` fails without it).
#![cfg(feature = "cuda")]

use cudarc::driver::{CudaContext, CudaStream};
use optimus::plan::layout::Placement;
use optimus::plan::types::DType;
use optimus::plan::{CollectiveKind, Coords, Group, Mesh, ReduceOp};
use optimus::runtime::bf16;
use optimus::runtime::comm::{CollectiveSpec, Communicator};
use optimus::runtime::cpu::threads::{Fabric, ThreadComm};
use optimus::runtime::cuda::DeviceCollectives;
use optimus::runtime::cuda::fabric::{SharedGpu, SharedGpuEndpoint};
use optimus::runtime::cuda::kernels::{CudaKernels, DeviceBuf, DeviceTensor};
use optimus::runtime::view::{Shape, View, ViewData};
use std::sync::Arc;
use std::time::Duration;

type R = Result<(), String>;

fn required(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| v == "1")
}

/// Whether a GPU can run kernels here (printing why not, or failing when one is required).
fn gpu_present(what: &str) -> Result<bool, String> {
    let skip = |why: &str| {
        if required("OPTIMUS_REQUIRE_CUDA") {
            Err(format!("OPTIMUS_REQUIRE_CUDA=1 but {why}"))
        } else {
            eprintln!("skipped (not run on a GPU): {what}, because {why}");
            Ok(false)
        }
    };
    // SAFETY: only tries to open the shared libraries.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return skip("the CUDA driver (libcuda) cannot be loaded");
    }
    if !matches!(CudaContext::device_count(), Ok(n) if n > 0) {
        return skip("there is no usable GPU");
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return skip("libnvrtc cannot be loaded");
    }
    Ok(true)
}

/// One collective of the test program.
#[derive(Clone, Copy, Debug)]
struct Case {
    kind: CollectiveKind,
    group: Group,
    root: Option<u64>,
    op: ReduceOp,
    shard: Option<Placement>,
    /// The gathered (or whole) tensor's shape.
    full: [u64; 3],
    bf16: bool,
}

impl Case {
    fn spec(&self) -> CollectiveSpec<'_> {
        CollectiveSpec {
            kind: self.kind,
            group: self.group,
            root: self.root,
            op: self.op,
            shard: self.shard,
            full: &self.full,
        }
    }

    /// The case for a group of `parts` members (a root that exists).
    fn for_group(mut self, parts: u64) -> Case {
        self.root = self.root.map(|r| r % parts);
        self
    }

    /// (elements sent, elements received) by each member of a group of `parts`.
    fn lens(&self, parts: u64) -> (usize, usize) {
        let full: u64 = self.full.iter().product();
        let block = (full / parts) as usize;
        match self.kind {
            CollectiveKind::AllGather => (block, full as usize),
            CollectiveKind::ReduceScatter => (full as usize, block),
            _ => (full as usize, full as usize),
        }
    }
}

/// Every kind over every group, with contiguous and strided splits, in f32 and bf16 (the split
/// dimensions divide by every group size of the meshes tested: 1, 2, 3, 4 and 16).
fn program() -> Vec<Case> {
    let split = |dim: u8, outer: u64| Some(Placement::Shard { dim, outer, inner: 1 });
    let heads = Some(Placement::Shard { dim: 2, outer: 3, inner: 2 });
    let mut cases = Vec::new();
    for bf16 in [false, true] {
        for group in [Group::Row, Group::Column, Group::Data, Group::Depth, Group::World] {
            let case = |kind, root, op, shard, full| Case { kind, group, root, op, shard, full, bf16 };
            use CollectiveKind::*;
            cases.extend([
                case(AllReduce, None, ReduceOp::Sum, None, [3, 5, 7]),
                case(AllReduce, None, ReduceOp::Max, None, [2, 1, 9]),
                case(Broadcast, Some(1), ReduceOp::Sum, None, [4, 4, 5]),
                case(Broadcast, Some(0), ReduceOp::Sum, None, [1, 1, 3]),
                case(Reduce, Some(1), ReduceOp::Sum, None, [3, 2, 8]),
                case(AllGather, None, ReduceOp::Sum, split(1, 1), [3, 48, 5]),
                case(AllGather, None, ReduceOp::Sum, split(2, 2), [2, 3, 96]),
                case(AllGather, None, ReduceOp::Sum, heads, [2, 2, 288]),
                case(ReduceScatter, None, ReduceOp::Sum, split(0, 1), [48, 3, 3]),
                case(ReduceScatter, None, ReduceOp::Sum, split(2, 2), [3, 2, 96]),
                case(ReduceScatter, None, ReduceOp::Max, heads, [1, 3, 288]),
            ]);
        }
    }
    cases
}

/// Member-specific values, distinct per round, with sums that bf16 rounds differently step by step
/// than once.
fn values(rank: u64, round: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|k| 1.0 + ((rank as usize * 7 + round * 3 + k) % 13) as f32 * 2f32.powi(-7) - 0.03 * rank as f32)
        .collect()
}

/// The host thread fabric's result of one case for the device at `coords`.
fn on_host(comm: &mut ThreadComm, case: &Case, send: &[f32], recv_len: usize) -> Result<Vec<u32>, String> {
    if case.bf16 {
        let send: Vec<u16> = send.iter().map(|&x| bf16::round(x)).collect();
        let mut recv = vec![0u16; recv_len];
        comm.collective(&case.spec(), &send, &mut recv).map_err(|e| e.to_string())?;
        Ok(recv.into_iter().map(u32::from).collect())
    } else {
        let mut recv = vec![0.0f32; recv_len];
        comm.collective(&case.spec(), send, &mut recv).map_err(|e| e.to_string())?;
        Ok(recv.into_iter().map(f32::to_bits).collect())
    }
}

/// A device tensor of `values` (rounded to bf16 where asked) and its address.
fn device_buffer(stream: &Arc<CudaStream>, values: &[f32], bf16_elements: bool) -> Result<DeviceTensor, String> {
    let shape = [values.len() as u64];
    if bf16_elements {
        let bits: Vec<u16> = values.iter().map(|&x| bf16::round(x)).collect();
        DeviceTensor::upload_view(stream, &View { shape: Shape(&shape), data: ViewData::Bf16(&bits) })
            .map_err(String::from)
    } else {
        DeviceTensor::upload_view(stream, &View { shape: Shape(&shape), data: ViewData::F32(values) })
            .map_err(String::from)
    }
}

/// The bits of a device tensor's elements (u16 patterns of bf16 widened to u32).
fn device_bits(stream: &Arc<CudaStream>, t: &DeviceTensor) -> Result<Vec<u32>, String> {
    let host = t.download(stream)?;
    let values = host.f32()?;
    Ok(if t.data.dtype() == DType::Bf16 {
        values.iter().map(|&x| u32::from(bf16::round(x))).collect()
    } else {
        values.iter().map(|x| x.to_bits()).collect()
    })
}

/// Runs `program` on one device thread: each case on the GPU communicator (then zeroes the send buffer
/// at once, as a later kernel of the plan may) and on the host fabric, and compares the results bit for
/// bit.
fn device_thread(
    mesh: Mesh,
    rank: u64,
    fabric: Arc<Fabric>,
    gpu: Arc<SharedGpu>,
    cases: &[Case],
) -> Result<usize, String> {
    let coords = mesh.coords_of(rank);
    let ctx = CudaContext::new(0).map_err(|e| e.to_string())?;
    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
    let kernels = CudaKernels::new(&ctx, stream.clone())?;
    let mut endpoint = SharedGpuEndpoint::new(gpu, mesh, coords, &stream)?;
    let mut host = ThreadComm::new(fabric, coords);
    let mut checked = 0;
    for (round, case) in cases.iter().enumerate() {
        let parts = mesh.group_size(case.group);
        let case = &case.for_group(parts);
        let (send_len, recv_len) = case.lens(parts);
        let send_values = values(rank, round, send_len);
        let mut send = device_buffer(&stream, &send_values, case.bf16)?;
        let recv = device_buffer(&stream, &vec![0.0; recv_len], case.bf16)?;
        let (send_buf, recv_buf) = (DeviceBuf::of(&send, &stream)?, DeviceBuf::of(&recv, &stream)?);
        let took = endpoint.run(&kernels, &case.spec(), send_buf, recv_buf).map_err(|e| e.to_string())?;
        assert!(took, "{case:?}: the shared-GPU communicator takes every collective of up to 64 members");
        match &mut send.data {
            optimus::runtime::cuda::kernels::DeviceData::F32(s) => stream.memset_zeros(s),
            optimus::runtime::cuda::kernels::DeviceData::Bf16(s) => stream.memset_zeros(s),
            optimus::runtime::cuda::kernels::DeviceData::I32(s) => stream.memset_zeros(s),
        }
        .map_err(|e| e.to_string())?;
        let want = on_host(&mut host, case, &send_values, recv_len)?;
        let got = device_bits(&stream, &recv)?;
        let root_only = case.kind == CollectiveKind::Reduce && case.root != Some(case.group.member_index(coords, mesh));
        if !root_only {
            assert_eq!(got, want, "device {coords}, {case:?}");
            checked += 1;
        }
    }
    Ok(checked)
}

fn shared_gpu_equals_the_thread_fabric(mesh: Mesh) -> R {
    if !gpu_present(&format!("shared-GPU collectives on a {mesh} mesh"))? {
        return Ok(());
    }
    let fabric = Fabric::new(mesh, Duration::from_secs(60));
    let gpu = SharedGpu::new(Arc::clone(&fabric));
    let cases = program();
    let results: Vec<Result<usize, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..mesh.devices())
            .map(|rank| {
                let (fabric, gpu, cases) = (Arc::clone(&fabric), Arc::clone(&gpu), &cases);
                s.spawn(move || device_thread(mesh, rank, fabric, gpu, cases))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a device thread panicked".into()))).collect()
    });
    let mut checked = 0;
    for r in results {
        checked += r?;
    }
    println!("{mesh}: {checked} results equal bit for bit");
    assert!(checked >= cases.len() * mesh.devices() as usize / 2);
    Ok(())
}

#[test]
fn shared_gpu_collectives_equal_the_thread_fabric_on_2x2() -> R {
    shared_gpu_equals_the_thread_fabric(Mesh::new(2, 2))
}

#[test]
fn shared_gpu_collectives_equal_the_thread_fabric_on_2x4x2() -> R {
    shared_gpu_equals_the_thread_fabric(Mesh::new(2, 4).with_data(2))
}

#[test]
fn shared_gpu_collectives_equal_the_thread_fabric_on_3x1() -> R {
    shared_gpu_equals_the_thread_fabric(Mesh::new(3, 1))
}

/// NCCL refuses two ranks on one GPU, so on a one-GPU machine its device path runs with one-member
/// groups (a 1x1 mesh): every kind, in f32 and bf16, must give what the shared-GPU communicator gives.
#[test]
fn nccl_on_device_pointers_with_one_member_groups_equals_the_shared_gpu() -> R {
    use optimus::runtime::cuda::nccl::{NcclDevice, ids_for_threads};
    if !gpu_present("NCCL on device pointers")? {
        return Ok(());
    }
    // SAFETY: only tries to open the shared library.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        assert!(!required("OPTIMUS_REQUIRE_NCCL"), "OPTIMUS_REQUIRE_NCCL=1 but libnccl cannot be loaded");
        eprintln!("skipped: libnccl cannot be loaded");
        return Ok(());
    }
    let mesh = Mesh::new(1, 1);
    let coords = Coords::new(0, 0, 0);
    let ids = ids_for_threads(mesh)?;
    let ctx = CudaContext::new(0).map_err(|e| e.to_string())?;
    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
    let kernels = CudaKernels::new(&ctx, stream.clone())?;
    let mut nccl = NcclDevice::new(&stream, mesh, coords, ids[0])?;
    let gpu = SharedGpu::new(Fabric::new(mesh, Duration::from_secs(60)));
    let mut shared = SharedGpuEndpoint::new(gpu, mesh, coords, &stream)?;
    let mut checked = 0;
    for (round, case) in program().iter().enumerate() {
        let case = &case.for_group(1);
        let (send_len, recv_len) = case.lens(1);
        let send = device_buffer(&stream, &values(0, round, send_len), case.bf16)?;
        let mut results = Vec::new();
        for endpoint in [&mut nccl as &mut dyn DeviceCollectives, &mut shared] {
            let recv = device_buffer(&stream, &vec![-7.0; recv_len], case.bf16)?;
            let (s, r) = (DeviceBuf::of(&send, &stream)?, DeviceBuf::of(&recv, &stream)?);
            assert!(endpoint.run(&kernels, &case.spec(), s, r).map_err(|e| e.to_string())?, "{case:?} taken");
            results.push(device_bits(&stream, &recv)?);
        }
        assert_eq!(results[0], results[1], "{case:?}: NCCL and the shared GPU differ");
        assert_eq!(results[0], device_bits(&stream, &send)?, "{case:?}: one member's result is its own block");
        checked += 1;
    }
    println!("NCCL {checked} collectives on device pointers equal the shared-GPU communicator");
    Ok(())
}
