//! Device-resident storage of the CUDA backend: one GPU allocation per device, laid out by the plan's
//! [`ArenaLayout`] (so buffers of disjoint lifetimes share memory exactly as in the host arena), and one
//! [`DeviceTensor`] per buffer that aliases its region. Data crosses to the host only where the executor
//! asks: uploads of parameters and inputs, downloads of the loss, outputs and checkpoints, and the
//! blocks of collectives where no device communicator takes them (see `super`).

use super::kernels::{DeviceData, DeviceTensor};
use crate::arena::{ALIGN_WORDS, ArenaLayout, words};
use crate::backend::Exchanges;
use crate::bf16;
use crate::error::{RuntimeError, StorageError};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};
use optimus_plan::tensor::{Data, Tensor};
use optimus_plan::types::DType;
use optimus_plan::{BufferId, Plan};
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// A buffer's tensor: a view of the arena, never freed on its own (dropping it gives the pointer back to
/// nobody: the arena owns the memory).
struct Alias(ManuallyDrop<DeviceTensor>);

impl Drop for Alias {
    fn drop(&mut self) {
        // SAFETY: the tensor is taken once, here, and never used again.
        let tensor = unsafe { ManuallyDrop::take(&mut self.0) };
        let _ = match tensor.data {
            DeviceData::F32(s) => s.leak(),
            DeviceData::I32(s) => s.leak(),
            DeviceData::Bf16(s) => s.leak(),
        };
    }
}

/// One buffer's place: its tensor and its name (for messages).
struct Slot {
    alias: Alias,
    name: String,
}

/// Every buffer of one device in one GPU allocation.
pub struct DeviceArena {
    slots: Vec<Option<Slot>>,
    /// The allocation the slots alias; declared last, so it is freed after them.
    _arena: CudaSlice<f32>,
}

fn storage_error(what: &str) -> impl Fn(cudarc::driver::DriverError) -> RuntimeError + '_ {
    move |e| RuntimeError::Storage(StorageError::Device(super::error::driver(what)(e)))
}

/// A typed slice of `len` elements (at least one) at byte address `at` of an allocation.
///
/// # Safety
/// `at .. at + len * size_of::<T>()` must lie inside a live allocation that outlives the slice, and the
/// slice must be given back with `leak`, never dropped.
unsafe fn alias_at<T>(stream: &Arc<CudaStream>, at: u64, len: usize) -> CudaSlice<T> {
    // SAFETY: as the caller promises.
    unsafe { stream.upgrade_device_ptr::<T>(at, len.max(1)) }
}

impl DeviceArena {
    /// Allocates one device's storage on `stream`, zero-filled, as `layout` places the plan's buffers.
    pub fn new(stream: &Arc<CudaStream>, plan: &Plan, layout: &ArenaLayout) -> Result<DeviceArena, RuntimeError> {
        // Slack past the end, so that a zero-length buffer's one-element alias stays inside.
        let total = layout.total + ALIGN_WORDS;
        let arena =
            stream.alloc_zeros::<f32>(total).map_err(|error| StorageError::Allocation { bytes: total * 4, error })?;
        let base = {
            let (ptr, _record) = arena.device_ptr(stream);
            ptr
        };
        let mut slots = Vec::with_capacity(plan.buffers.len());
        for b in &plan.buffers {
            let Some(offset) = layout.offsets.get(b.id.0 as usize).copied().flatten() else {
                slots.push(None);
                continue;
            };
            if offset + words(b) > layout.total {
                return Err(StorageError::PastEnd { buffer: b.name.clone() }.into());
            }
            let (at, n) = (base + 4 * offset as u64, b.elements() as usize);
            // SAFETY: the region lies inside `arena` (checked above; the slack covers n = 0), which the
            // slots never outlive, and `Alias` leaks the slice instead of freeing it.
            let data = unsafe {
                match b.dtype {
                    DType::Bf16 => DeviceData::Bf16(alias_at(stream, at, n)),
                    d if d.is_integer() => DeviceData::I32(alias_at(stream, at, n)),
                    _ => DeviceData::F32(alias_at(stream, at, n)),
                }
            };
            let tensor = DeviceTensor { shape: b.shape.clone(), data };
            slots.push(Some(Slot { alias: Alias(ManuallyDrop::new(tensor)), name: b.name.clone() }));
        }
        Ok(DeviceArena { slots, _arena: arena })
    }

    fn slot(&self, id: BufferId) -> Result<&Slot, RuntimeError> {
        self.slots.get(id.0 as usize).and_then(Option::as_ref).ok_or(RuntimeError::Storage(StorageError::NoPlace(id)))
    }

    /// A buffer's tensor.
    pub fn tensor(&self, id: BufferId) -> Result<&DeviceTensor, RuntimeError> {
        Ok(&self.slot(id)?.alias.0)
    }

    /// The buffers `reads` (may repeat) and, mutably, `write` (not among them), for one kernel.
    pub fn operands(
        &mut self,
        reads: &[BufferId],
        write: BufferId,
    ) -> Result<(Vec<&DeviceTensor>, &mut DeviceTensor), RuntimeError> {
        if let Some(id) = reads.iter().find(|&&id| id == write) {
            return Err(RuntimeError::ReadAndWritten { buffer: self.slot(*id)?.name.clone() });
        }
        self.slot(write)?;
        for &id in reads {
            self.slot(id)?;
        }
        let mut ins: Vec<Option<&DeviceTensor>> = vec![None; reads.len()];
        let mut out = None;
        for (k, slot) in self.slots.iter_mut().enumerate() {
            let Some(slot) = slot.as_mut() else { continue };
            if k == write.0 as usize {
                out = Some(&mut *slot.alias.0);
                continue;
            }
            let shared: &Slot = slot;
            for (r, id) in reads.iter().enumerate() {
                if id.0 as usize == k {
                    ins[r] = Some(&*shared.alias.0);
                }
            }
        }
        let out = out.ok_or(StorageError::Unplaced("the written buffer"))?;
        let ins = ins.into_iter().map(|t| t.ok_or(StorageError::Unplaced("a read buffer")));
        Ok((ins.collect::<Result<Vec<_>, _>>()?, out))
    }

    /// Several distinct buffers, mutably (for the optimizer's in-place update).
    pub fn many_mut<const N: usize>(&mut self, ids: [BufferId; N]) -> Result<[&mut DeviceTensor; N], RuntimeError> {
        for (k, id) in ids.iter().enumerate() {
            self.slot(*id)?;
            if ids[..k].contains(id) {
                return Err(RuntimeError::ReadAndWritten { buffer: self.slot(*id)?.name.clone() });
            }
        }
        let mut found: [Option<&mut DeviceTensor>; N] = std::array::from_fn(|_| None);
        for (k, slot) in self.slots.iter_mut().enumerate() {
            if let (Some(slot), Some(at)) = (slot.as_mut(), ids.iter().position(|id| id.0 as usize == k)) {
                found[at] = Some(&mut *slot.alias.0);
            }
        }
        let all: Vec<&mut DeviceTensor> = found.into_iter().flatten().collect();
        all.try_into().map_err(|_| StorageError::Unplaced("an optimizer buffer").into())
    }

    /// Zero-fills a buffer.
    pub fn zero(&mut self, stream: &Arc<CudaStream>, id: BufferId) -> Result<(), RuntimeError> {
        let tensor = &mut *self.slots[id.0 as usize].as_mut().ok_or_else(|| missing(id))?.alias.0;
        if tensor.is_empty() {
            return Ok(());
        }
        let zeroed = match &mut tensor.data {
            DeviceData::F32(s) => stream.memset_zeros(s),
            DeviceData::I32(s) => stream.memset_zeros(s),
            DeviceData::Bf16(s) => stream.memset_zeros(s),
        };
        zeroed.map_err(storage_error("zero-filling a GPU buffer"))
    }

    /// Copies a host tensor into a buffer (f32 values into a bf16 buffer are rounded once).
    pub fn upload(&mut self, stream: &Arc<CudaStream>, id: BufferId, tensor: &Tensor) -> Result<(), RuntimeError> {
        let slot = self.slots.get_mut(id.0 as usize).and_then(Option::as_mut).ok_or_else(|| missing(id))?;
        let dst = &mut *slot.alias.0;
        if dst.shape != tensor.shape {
            let (tensor, buffer, name) = (tensor.shape.clone(), dst.shape.clone(), Some(slot.name.clone()));
            return Err(StorageError::Misfit { tensor, buffer, name }.into());
        }
        match (&mut dst.data, &tensor.data) {
            (DeviceData::F32(d), Data::F32(s)) => copy_in(stream, s, d),
            (DeviceData::I32(d), Data::I32(s)) => copy_in(stream, s, d),
            (DeviceData::Bf16(d), Data::F32(s)) => {
                copy_in(stream, &s.iter().map(|&x| bf16::round(x)).collect::<Vec<_>>(), d)
            }
            _ => Err(StorageError::ElementType { name: Some(slot.name.clone()) }.into()),
        }
    }

    /// A host copy of a buffer (bf16 widened to f32); waits for the GPU.
    pub fn download(&self, stream: &Arc<CudaStream>, id: BufferId) -> Result<Tensor, RuntimeError> {
        Ok(self.tensor(id)?.download(stream).map_err(StorageError::Transfer)?)
    }

    /// Lends `exchange` a collective's send and receive blocks through host copies: bf16 pairs travel as
    /// bf16, f32 pairs as f32, a mixed pair widened to f32 (the sum rounded once into a bf16 receiver),
    /// as the host arena does.
    pub fn exchange(
        &mut self,
        stream: &Arc<CudaStream>,
        send: BufferId,
        recv: BufferId,
        exchange: &mut dyn Exchanges,
    ) -> Result<(), RuntimeError> {
        if send == recv {
            return Err(RuntimeError::ReadAndWritten { buffer: self.slot(send)?.name.clone() });
        }
        let (s, r) = (self.tensor(send)?, self.tensor(recv)?);
        let (n_send, n_recv) = (s.len(), r.len());
        match (&s.data, &r.data) {
            (DeviceData::Bf16(s), DeviceData::Bf16(r)) => {
                let (sent, mut got) = (copy_out(stream, s, n_send)?, copy_out(stream, r, n_recv)?);
                exchange.bf16(&sent, &mut got).map_err(RuntimeError::Comm)?;
                self.write_back(stream, recv, HostBlock::Bf16(got))
            }
            (DeviceData::I32(_), _) | (_, DeviceData::I32(_)) => Err(StorageError::NotFloat { name: None }.into()),
            (s, r) => {
                let sent = widened(stream, s, n_send)?;
                let mut got = widened(stream, r, n_recv)?;
                exchange.f32(&sent, &mut got).map_err(RuntimeError::Comm)?;
                self.write_back(stream, recv, HostBlock::F32(got))
            }
        }
    }

    fn write_back(&mut self, stream: &Arc<CudaStream>, id: BufferId, block: HostBlock) -> Result<(), RuntimeError> {
        let dst = &mut *self.slots[id.0 as usize].as_mut().ok_or_else(|| missing(id))?.alias.0;
        match (&mut dst.data, block) {
            (DeviceData::F32(d), HostBlock::F32(v)) => copy_in(stream, &v, d),
            (DeviceData::Bf16(d), HostBlock::Bf16(v)) => copy_in(stream, &v, d),
            (DeviceData::Bf16(d), HostBlock::F32(v)) => {
                copy_in(stream, &v.iter().map(|&x| bf16::round(x)).collect::<Vec<_>>(), d)
            }
            _ => Err(StorageError::ResultMismatch.into()),
        }
    }
}

/// A receive block on the host, in its wire type.
enum HostBlock {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}

fn missing(id: BufferId) -> RuntimeError {
    RuntimeError::Storage(StorageError::NoPlace(id))
}

fn copy_in<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    src: &[T],
    dst: &mut CudaSlice<T>,
) -> Result<(), RuntimeError> {
    if src.is_empty() {
        return Ok(());
    }
    let mut head = dst.try_slice_mut(..src.len()).ok_or(RuntimeError::Storage(StorageError::HostBlockTooLarge))?;
    stream.memcpy_htod(src, &mut head).map_err(storage_error("copying to the GPU"))
}

fn copy_out<T: DeviceRepr + ValidAsZeroBits + Default + Clone>(
    stream: &Arc<CudaStream>,
    src: &CudaSlice<T>,
    n: usize,
) -> Result<Vec<T>, RuntimeError> {
    let mut out = vec![T::default(); n];
    if n == 0 {
        return Ok(out);
    }
    let head = src.try_slice(..n).ok_or(RuntimeError::Storage(StorageError::GpuBufferShort))?;
    stream.memcpy_dtoh(&head, &mut out).map_err(storage_error("copying from the GPU"))?;
    stream.synchronize().map_err(storage_error("waiting for the GPU"))?;
    Ok(out)
}

/// The first `n` elements of a floating-point GPU buffer as f32 on the host.
fn widened(stream: &Arc<CudaStream>, data: &DeviceData, n: usize) -> Result<Vec<f32>, RuntimeError> {
    match data {
        DeviceData::F32(s) => copy_out(stream, s, n),
        DeviceData::Bf16(s) => Ok(bf16::widen(&copy_out(stream, s, n)?)),
        DeviceData::I32(_) => Err(StorageError::NotFloat { name: None }.into()),
    }
}
