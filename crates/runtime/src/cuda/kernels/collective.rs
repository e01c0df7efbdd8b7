//! Launches of the collective kernels of `collectives.cu` on buffers named by device address: a member
//! of a group on a shared GPU reads its peers' buffers in place, and NCCL's member-major blocks are
//! packed and unpacked on the GPU.

use super::*;
use crate::comm::BlockGeometry;
use crate::error::StorageError;
use cudarc::driver::DevicePtr;

const REDUCE_MEMBERS: &str = "reduce_members";
const GATHER_MEMBERS: &str = "gather_members";
const PACK_MEMBERS: &str = "pack_members";

/// Every `__global__` function of collectives.cu.
pub const COLLECTIVE_KERNEL_NAMES: &[&str] = &[REDUCE_MEMBERS, GATHER_MEMBERS, PACK_MEMBERS];

/// The most members one launch reads (collectives.cu's `MAX_MEMBERS`).
pub const MAX_MEMBERS: usize = 64;

/// A floating-point buffer on the GPU by address: where it starts, its elements, and whether they are
/// bf16 (two bytes) or f32 (four).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBuf {
    pub ptr: u64,
    pub len: usize,
    pub bf16: bool,
}

impl DeviceBuf {
    /// The address of a tensor's elements (f32 or bf16; integer tensors are never communicated).
    pub fn of(t: &DeviceTensor, stream: &Arc<CudaStream>) -> Result<DeviceBuf, StorageError> {
        let len = t.len();
        match &t.data {
            DeviceData::F32(s) => Ok(DeviceBuf { ptr: s.device_ptr(stream).0, len, bf16: false }),
            DeviceData::Bf16(s) => Ok(DeviceBuf { ptr: s.device_ptr(stream).0, len, bf16: true }),
            DeviceData::I32(_) => Err(StorageError::NotFloat { name: None }),
        }
    }

    /// Bytes of one element.
    pub fn element_bytes(&self) -> usize {
        if self.bf16 { 2 } else { 4 }
    }

    /// Bytes of the whole buffer.
    pub fn bytes(&self) -> usize {
        self.len * self.element_bytes()
    }
}

/// The members' buffers as the kernels take them (by value, [`MAX_MEMBERS`] at most).
#[repr(C)]
#[derive(Clone, Copy)]
struct Members {
    ptr: [u64; MAX_MEMBERS],
}

// SAFETY: plain data laid out as collectives.cu's `Members`.
unsafe impl DeviceRepr for Members {}

impl Members {
    fn of(bufs: &[DeviceBuf]) -> Result<(Members, u32), KernelError> {
        require(!bufs.is_empty() && bufs.len() <= MAX_MEMBERS, || {
            KernelError::Invalid(format!(
                "a collective on a shared GPU takes 1 to {MAX_MEMBERS} members, not {}",
                bufs.len()
            ))
        })?;
        let mut ptr = [0u64; MAX_MEMBERS];
        ptr.iter_mut().zip(bufs).for_each(|(p, b)| *p = b.ptr);
        Ok((Members { ptr }, bufs.len() as u32))
    }
}

/// One member's runs in a gathered tensor, as collectives.cu's `Runs`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Runs {
    run: u64,
    outer: u64,
    stride_b: u64,
    stride_o: u64,
    start: u64,
}

// SAFETY: plain data laid out as collectives.cu's `Runs`.
unsafe impl DeviceRepr for Runs {}

impl Runs {
    /// Element e at e: a whole buffer.
    fn whole(n: usize) -> Runs {
        Runs { run: n.max(1) as u64, outer: 1, stride_b: 0, stride_o: 0, start: 0 }
    }

    /// Member `member`'s runs (or, with `member` 0, where member-relative offsets start).
    fn of(g: &BlockGeometry, member: u64) -> Runs {
        Runs {
            run: g.run.max(1),
            outer: g.outer.max(1),
            stride_b: g.stride_b,
            stride_o: g.stride_o,
            start: member * g.member_stride,
        }
    }
}

/// The last element index a block of geometry `g` touches in the gathered tensor, plus one, for the
/// members `0..parts`.
fn gathered_extent(g: &BlockGeometry, parts: u64) -> u64 {
    if g.block_len() == 0 || parts == 0 {
        return 0;
    }
    (g.before - 1) * g.stride_b + (g.outer - 1) * g.stride_o + (parts - 1) * g.member_stride + g.run
}

fn u32_flag(b: bool) -> u32 {
    u32::from(b)
}

impl CudaKernels {
    /// `out` = the members' buffers combined element by element (sum, or maximum where `max`), in f32
    /// from member 0 on, stored once. With `block` = (geometry, m), each member contributes member m's
    /// block of its buffer (a reduce-scatter); otherwise whole buffers as long as `out`.
    pub fn reduce_members(
        &self,
        members: &[DeviceBuf],
        out: DeviceBuf,
        max: bool,
        block: Option<(BlockGeometry, u64)>,
    ) -> Result<(), KernelError> {
        let (table, count) = Members::of(members)?;
        let in_bf16 = members[0].bf16;
        let (runs, n, extent) = match block {
            None => (Runs::whole(out.len), out.len, out.len as u64),
            Some((g, m)) => (Runs::of(&g, m), g.block_len() as usize, gathered_extent(&g, m + 1)),
        };
        require(out.len == n, || size_mismatch(format!("a block of {n} into {} elements", out.len)))?;
        require(members.iter().all(|b| b.bf16 == in_bf16 && b.len as u64 >= extent), || {
            size_mismatch(format!("members' buffers {:?} for {extent} elements", lens(members)))
        })?;
        let (i, o, op, elements) = (u32_flag(in_bf16), u32_flag(out.bf16), u32_flag(max), n as u64);
        launch!(&self.dev, REDUCE_MEMBERS, elementwise(n), [&table, &count, &i, &o, &op, &runs, &out.ptr, &elements])
    }

    /// Member k's buffer (its block, of geometry `g`) into its runs of the gathered `out`, for every k.
    pub fn gather_members(&self, members: &[DeviceBuf], out: DeviceBuf, g: &BlockGeometry) -> Result<(), KernelError> {
        let (table, count) = Members::of(members)?;
        let n = g.block_len();
        let in_bf16 = members[0].bf16;
        require(members.iter().all(|b| b.bf16 == in_bf16 && b.len as u64 == n), || {
            size_mismatch(format!("blocks {:?} where {n} elements were expected", lens(members)))
        })?;
        require(gathered_extent(g, count as u64) <= out.len as u64, || {
            size_mismatch(format!("{count} blocks of {n} do not fit {} elements", out.len))
        })?;
        let (i, o, runs) = (u32_flag(in_bf16), u32_flag(out.bf16), Runs::of(g, 0));
        let cfg = elementwise(n as usize * count as usize);
        launch!(&self.dev, GATHER_MEMBERS, cfg, [&table, &count, &i, &o, &runs, &g.member_stride, &out.ptr, &n])
    }

    /// Member k's runs of `full` into block k of `out`, member-major, for k < `parts` (what NCCL's
    /// reduce-scatter takes).
    pub fn pack_members(
        &self,
        full: DeviceBuf,
        out: DeviceBuf,
        g: &BlockGeometry,
        parts: u64,
    ) -> Result<(), KernelError> {
        let n = g.block_len();
        require(full.bf16 == out.bf16 && gathered_extent(g, parts) <= full.len as u64, || {
            size_mismatch(format!("{parts} blocks of {n} from {} elements", full.len))
        })?;
        require(n * parts <= out.len as u64, || {
            KernelError::Invalid(format!("{parts} blocks of {n} do not fit {} elements", out.len))
        })?;
        let (bf16, runs, count) = (u32_flag(full.bf16), Runs::of(g, 0), parts as u32);
        let cfg = elementwise((n * parts) as usize);
        launch!(&self.dev, PACK_MEMBERS, cfg, [&full.ptr, &bf16, &runs, &g.member_stride, &out.ptr, &n, &count])
    }

    /// `dst` = `src` (as many elements), bits as they are for one element type, converted otherwise.
    pub fn copy_buffer(&self, src: DeviceBuf, dst: DeviceBuf) -> Result<(), KernelError> {
        require(src.len == dst.len, || size_mismatch(format!("{} elements into {}", src.len, dst.len)))?;
        if src.bf16 != dst.bf16 {
            return self.reduce_members(&[src], dst, false, None);
        }
        if src.len == 0 {
            return Ok(());
        }
        let stream = &self.dev.stream;
        stream.context().bind_to_thread().map_err(driver("binding the CUDA context"))?;
        // SAFETY: both ranges lie in live allocations of this context (their owners checked the lengths
        // against their buffers), and the copy is ordered on this device's stream.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst.ptr, src.ptr, src.bytes(), stream.cu_stream()) }
            .map_err(|e| driver("copying between GPU buffers")(e).into())
    }
}

/// A collective whose buffers do not fit each other (`what` says how).
fn size_mismatch(what: String) -> KernelError {
    KernelError::Invalid(format!("collective size mismatch: {what}"))
}

fn lens(bufs: &[DeviceBuf]) -> Vec<usize> {
    bufs.iter().map(|b| b.len).collect()
}
