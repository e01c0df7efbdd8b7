//! One device's storage laid out once from the plan: every buffer gets a fixed region of a single
//! allocation, reused every step. [`layout`] places buffers by their lifetimes in the program (from
//! first use to their `Free`), so that buffers alive at the same time never share memory;
//! [`HostArena`] is that allocation in host memory, handing kernels disjoint views of it.
//!
//! Offsets and sizes are in 4-byte words: host storage keeps f32 buffers as f32, integer buffers
//! (token ids) as i32, and bf16 buffers as two bf16 bit patterns per word, so that a buffer takes the
//! bytes its dtype says and the arena matches the plan's memory figures.

use super::backend::Exchanges;
use super::bf16;
use super::comm::RawBlock;
use super::error::{RuntimeError, StorageError, unreachable};
use super::view::{Shape, View, ViewData, ViewMut, ViewMutData};
use crate::view::TensorViews;
use optimus_plan::memory::{persistent, touched};
use optimus_plan::tensor::Tensor;
use optimus_plan::types::DType;
use optimus_plan::{Buffer, BufferId, Instr, Plan};

/// Every region starts on a multiple of this many words (64 bytes, a cache line).
pub const ALIGN_WORDS: usize = 16;

/// Where each buffer lives in one device's storage.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ArenaLayout {
    /// The first word of each buffer (by buffer id); `None` for a buffer the device never holds.
    pub offsets: Vec<Option<usize>>,
    /// Words in all.
    pub total: usize,
}

/// When a buffer is alive, as program positions (both ends included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetime {
    pub start: usize,
    pub end: usize,
}

impl Lifetime {
    pub fn overlaps(self, other: Lifetime) -> bool {
        self.start <= other.end && other.start <= self.end
    }
}

/// Words a buffer takes on the host: one per element, or one per two bf16 elements.
pub fn words(buffer: &Buffer) -> usize {
    let elements = buffer.elements() as usize;
    if buffer.dtype == DType::Bf16 { elements.div_ceil(2) } else { elements }
}

/// How a region's words hold its elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Elem {
    F32,
    I32,
    /// Two bf16 bit patterns per word.
    Bf16,
}

impl Elem {
    fn of(dtype: DType) -> Elem {
        match dtype {
            DType::Bf16 => Elem::Bf16,
            d if d.is_integer() => Elem::I32,
            _ => Elem::F32,
        }
    }
}

fn aligned(words: usize) -> usize {
    words.div_ceil(ALIGN_WORDS) * ALIGN_WORDS
}

/// The lifetime of every buffer: persistent buffers (parameters, optimizer state, inputs) span the
/// whole program; any other buffer runs from the first instruction that touches it to its last
/// `Free`, or to the end of the program when it is kept (never freed). `None` if never touched.
pub fn lifetimes(plan: &Plan) -> Vec<Option<Lifetime>> {
    let end_of_program = plan.program.len();
    let mut spans: Vec<Option<Lifetime>> = vec![None; plan.buffers.len()];
    let mut freed = vec![false; plan.buffers.len()];
    for (index, instr) in plan.program.iter().enumerate() {
        for id in touched(instr) {
            let Some(span) = spans.get_mut(id.0 as usize) else { continue };
            let s = span.get_or_insert(Lifetime { start: index, end: index });
            s.end = index;
        }
        if let Instr::Free { buffer } = instr
            && let Some(f) = freed.get_mut(buffer.0 as usize)
        {
            *f = true;
        }
    }
    for (b, span) in plan.buffers.iter().zip(spans.iter_mut()) {
        if persistent(b.role) {
            *span = Some(Lifetime { start: 0, end: end_of_program });
        } else if let Some(s) = span.as_mut().filter(|_| !freed[b.id.0 as usize]) {
            s.end = end_of_program;
        }
    }
    spans
}

/// Lays out one device's storage: persistent buffers first, back to back, then every other buffer,
/// largest first, into the best-fitting gap among the buffers already placed whose lifetimes overlap
/// its own (offline "greedy by size" placement).
pub fn layout(plan: &Plan) -> ArenaLayout {
    let spans = lifetimes(plan);
    let mut offsets = vec![None; plan.buffers.len()];
    let mut base = 0;
    for b in persistent_in_order(plan) {
        offsets[b.id.0 as usize] = Some(base);
        base += aligned(words(b));
    }
    let mut order: Vec<(&Buffer, Lifetime)> = plan
        .buffers
        .iter()
        .filter(|b| !persistent(b.role))
        .filter_map(|b| spans[b.id.0 as usize].map(|s| (b, s)))
        .collect();
    order.sort_by_key(|(b, s)| (std::cmp::Reverse(words(b)), s.start, b.id.0));
    let mut placed: Vec<(Lifetime, usize, usize)> = Vec::with_capacity(order.len());
    let mut total = base;
    for (b, span) in order {
        let size = aligned(words(b));
        let offset = best_fit(&placed, span, size, base);
        offsets[b.id.0 as usize] = Some(offset);
        placed.push((span, offset, offset + size));
        total = total.max(offset + size);
    }
    ArenaLayout { offsets, total }
}

/// The persistent buffers in the order the arena places them: the parameters (in the plan's order),
/// then the key/value caches, then the rest (optimizer state, inputs), each in buffer order. Two plans
/// of one model on one mesh (a generation's prefill and decode programs) thus place their parameters
/// and caches at the same offsets, and a device's storage can pass from one to the other whole
/// ([`HostArena::relayout`]).
fn persistent_in_order(plan: &Plan) -> Vec<&Buffer> {
    let mut order: Vec<&Buffer> = plan.params.iter().map(|p| plan.buffer(p.buffer)).collect();
    let placed: std::collections::HashSet<_> = order.iter().map(|b| b.id).collect();
    let rest = plan.buffers.iter().filter(|b| persistent(b.role) && !placed.contains(&b.id));
    let (caches, others): (Vec<&Buffer>, Vec<&Buffer>) = rest.partition(|b| b.role == optimus_plan::Role::Cache);
    order.extend(caches);
    order.extend(others);
    order
}

/// Whether `to` places every parameter and key/value cache of `from` (matched by name) at the same
/// offset, with the same size, element type and layout (the same block of the same tensor on every
/// device): then `from`'s storage serves `to` as it is.
pub fn places_alike(from: (&Plan, &ArenaLayout), to: (&Plan, &ArenaLayout)) -> bool {
    let carried = |plan: &Plan| -> Vec<BufferId> {
        let caches = plan.buffers.iter().filter(|b| b.role == optimus_plan::Role::Cache).map(|b| b.id);
        plan.params.iter().map(|p| p.buffer).chain(caches).collect()
    };
    let placed = |(plan, layout): (&Plan, &ArenaLayout), id: BufferId| {
        let b = plan.buffer(id);
        let at = layout.offsets.get(id.0 as usize).copied().flatten();
        (b.name.clone(), at, words(b), Elem::of(b.dtype), b.layout)
    };
    let (ours, theirs) = (carried(from.0), carried(to.0));
    ours.len() == theirs.len()
        && ours.iter().zip(&theirs).all(|(&a, &b)| {
            let (a, b) = (placed(from, a), placed(to, b));
            a.1.is_some() && a == b
        })
}

/// The start of the smallest gap of at least `size` words above `base` among the regions of `placed`
/// alive during `span`, or the end of the highest such region.
fn best_fit(placed: &[(Lifetime, usize, usize)], span: Lifetime, size: usize, base: usize) -> usize {
    let mut busy: Vec<(usize, usize)> =
        placed.iter().filter(|(s, _, _)| s.overlaps(span)).map(|&(_, start, end)| (start, end)).collect();
    busy.sort_unstable();
    let mut cursor = base;
    let mut best: Option<(usize, usize)> = None;
    for (start, end) in busy {
        if start > cursor {
            let gap = start - cursor;
            if gap >= size && best.is_none_or(|(_, g)| gap < g) {
                best = Some((cursor, gap));
            }
        }
        cursor = cursor.max(end);
    }
    best.map_or(cursor, |(at, _)| at)
}

/// One buffer's region and element type in a [`HostArena`].
#[derive(Clone, Debug)]
struct Region {
    offset: usize,
    /// Words.
    len: usize,
    elements: usize,
    elem: Elem,
    shape: Vec<u64>,
    name: String,
}

/// A device's buffers in one host allocation of 4-byte words, laid out by [`layout`].
pub struct HostArena {
    words: Vec<f32>,
    regions: Vec<Option<Region>>,
    /// Buffers read, for now, from another block of this process (a broadcast read in place): their
    /// reads see that block's words instead of their own region's.
    borrowed: Vec<(BufferId, RawBlock)>,
}

impl HostArena {
    /// Allocates the arena (zeroed) for `plan` as `layout` places its buffers.
    pub fn new(plan: &Plan, layout: &ArenaLayout) -> Result<HostArena, RuntimeError> {
        let regions = HostArena::regions(plan, layout)?;
        Ok(HostArena { words: vec![0.0; layout.total], regions, borrowed: Vec::new() })
    }

    /// Every buffer's region as `layout` places it, each checked to end within the arena.
    fn regions(plan: &Plan, layout: &ArenaLayout) -> Result<Vec<Option<Region>>, RuntimeError> {
        let regions = plan
            .buffers
            .iter()
            .map(|b| {
                let offset = layout.offsets.get(b.id.0 as usize).copied().flatten()?;
                let (elem, shape, name) = (Elem::of(b.dtype), b.shape.clone(), b.name.clone());
                Some(Region { offset, len: words(b), elements: b.elements() as usize, elem, shape, name })
            })
            .collect::<Vec<_>>();
        if let Some(r) = regions.iter().flatten().find(|r| r.offset + r.len > layout.total) {
            return Err(StorageError::PastEnd { buffer: r.name.clone() }.into());
        }
        Ok(regions)
    }

    /// The arena laid out for another plan, keeping its words: the buffers both plans place alike
    /// ([`places_alike`]) keep their contents; the arena grows (zero-filled) or shrinks to the new
    /// total.
    pub fn relayout(&mut self, plan: &Plan, layout: &ArenaLayout) -> Result<(), RuntimeError> {
        let fresh = HostArena::regions(plan, layout)?;
        self.regions = fresh;
        self.words.resize(layout.total, 0.0);
        Ok(())
    }

    /// Words allocated.
    pub fn total_words(&self) -> usize {
        self.words.len()
    }

    fn region(&self, id: BufferId) -> Result<&Region, RuntimeError> {
        region_of(&self.regions, id)
    }

    /// A buffer's contents.
    pub fn view(&self, id: BufferId) -> Result<View<'_>, RuntimeError> {
        let r = self.region(id)?;
        if let Some(words) = self.borrowed_words(id, r)? {
            return Ok(shared_view(r, words));
        }
        Ok(shared_view(r, &self.words[r.offset..r.offset + r.len]))
    }

    /// Where buffer `id`'s words are (a block of 4-byte words), for another device of this process to
    /// read in place while this one waits.
    pub fn raw_block(&self, id: BufferId) -> Result<RawBlock, RuntimeError> {
        let r = self.region(id)?;
        let words = &self.words[r.offset..r.offset + r.len];
        Ok(RawBlock { ptr: words.as_ptr().cast(), bytes: std::mem::size_of_val(words) })
    }

    /// Makes buffer `id` read `block` (the same number of words) until [`HostArena::end_borrow`]; it
    /// cannot be written meanwhile.
    ///
    /// # Safety
    /// `block` must stay alive and unwritten until `end_borrow(id)` is called.
    pub unsafe fn borrow(&mut self, id: BufferId, block: RawBlock) -> Result<(), RuntimeError> {
        let r = self.region(id)?;
        if block.bytes != r.len * size_of::<f32>() || !block.ptr.cast::<f32>().is_aligned() {
            return Err(unreachable("a borrowed block of the buffer's size and alignment"));
        }
        self.borrowed.push((id, block));
        Ok(())
    }

    /// Buffer `id` reads its own region again.
    pub fn end_borrow(&mut self, id: BufferId) {
        self.borrowed.retain(|(b, _)| *b != id);
    }

    /// The words buffer `id` borrows, if it does.
    fn borrowed_words(&self, id: BufferId, r: &Region) -> Result<Option<&[f32]>, RuntimeError> {
        let Some((_, block)) = self.borrowed.iter().find(|(b, _)| *b == id) else { return Ok(None) };
        // SAFETY: `borrow`'s caller keeps the block alive and unwritten until `end_borrow`, and it
        // holds `r.len` aligned words (checked there).
        Ok(Some(unsafe { std::slice::from_raw_parts(block.ptr.cast::<f32>(), r.len) }))
    }

    /// Whether the regions of `a` and `b` share a word (a buffer's with itself: when it has any).
    pub fn regions_overlap(&self, a: BufferId, b: BufferId) -> Result<bool, RuntimeError> {
        let (a, b) = (self.region(a)?, self.region(b)?);
        Ok(a.len > 0 && b.len > 0 && a.offset < b.offset + b.len && b.offset < a.offset + a.len)
    }

    /// A buffer's contents, writable.
    pub fn view_mut(&mut self, id: BufferId) -> Result<ViewMut<'_>, RuntimeError> {
        let r = region_of(&self.regions, id)?;
        Ok(writable_view(r, &mut self.words[r.offset..r.offset + r.len]))
    }

    /// Copies a host tensor into a buffer (shape and element type must match).
    pub fn write(&mut self, id: BufferId, tensor: &Tensor) -> Result<(), RuntimeError> {
        let mut view = self.view_mut(id)?;
        if view.shape.as_slice() != tensor.shape.as_slice() {
            let (tensor, buffer) = (tensor.shape.clone(), view.shape.to_vec());
            return Err(StorageError::Misfit { tensor, buffer, name: None }.into());
        }
        match (&mut view.data, tensor.view().data) {
            (ViewMutData::F32(dst), ViewData::F32(src)) => dst.copy_from_slice(src),
            (ViewMutData::I32(dst), ViewData::I32(src)) => dst.copy_from_slice(src),
            (ViewMutData::Bf16(dst), ViewData::F32(src)) => bf16::round_into(src, dst),
            _ => return Err(StorageError::ElementType { name: None }.into()),
        }
        Ok(())
    }

    /// Zero-fills a buffer (what a buffer holds when it comes alive).
    pub fn zero(&mut self, id: BufferId) -> Result<(), RuntimeError> {
        let (offset, len) = self.region(id).map(|r| (r.offset, r.len))?;
        self.words[offset..offset + len].fill(0.0);
        Ok(())
    }

    /// A host copy of a buffer.
    pub fn download(&self, id: BufferId) -> Result<Tensor, RuntimeError> {
        Ok(self.view(id)?.to_tensor())
    }

    /// A host copy of a buffer into `into`, in the allocation `into` already has where it is large
    /// enough (bf16 widened to f32, as [`HostArena::download`] does).
    pub fn download_into(&self, id: BufferId, into: &mut Tensor) -> Result<(), RuntimeError> {
        self.view(id)?.copy_into(into);
        Ok(())
    }

    /// The first NaN or infinity of a floating-point buffer, with its element index (`None` for an
    /// integer buffer).
    pub fn first_non_finite(&self, id: BufferId) -> Result<Option<(usize, f32)>, RuntimeError> {
        let view = self.view(id)?;
        let first = |v: &mut dyn Iterator<Item = f32>| v.enumerate().find(|(_, x)| !x.is_finite());
        Ok(match view.data {
            ViewData::F32(v) => first(&mut v.iter().copied()),
            ViewData::Bf16(v) => first(&mut v.iter().map(|&b| bf16::widen_one(b))),
            ViewData::I32(_) => None,
        })
    }

    /// Lends `exchange` a collective's send block and receive buffer (both floating point) as f32: bf16
    /// buffers are widened for the exchange, so sums are taken in f32 and rounded once into a bf16
    /// receive buffer.
    fn exchange_widened(
        &mut self,
        send: BufferId,
        recv: BufferId,
        elementwise: bool,
        exchange: &mut dyn Exchanges,
    ) -> Result<(), RuntimeError> {
        for id in [send, recv] {
            let r = self.region(id)?;
            if r.elem == Elem::I32 {
                return Err(StorageError::NotFloat { name: Some(r.name.clone()) }.into());
            }
        }
        let (ins, mut outs) = self.operands(&[send], &[recv])?;
        let (Some(send), Some(recv)) = (ins.first(), outs.first_mut()) else {
            return Err(unreachable("one send and one receive buffer"));
        };
        let mut exchange_f32 = |s: &[&super::view::View], r: &mut ViewMut| -> Result<(), RuntimeError> {
            let (Some(s), ViewMutData::F32(r)) = (s.first().and_then(|v| v.f32().ok()), &mut r.data) else {
                return Err(StorageError::CollectiveNeedsFloats.into());
            };
            Ok(exchange.f32(s, r)?)
        };
        // bf16 buffers are exchanged as f32 values: a piece at a time when the collective allows it, so
        // the widened copies stay small.
        let in_pieces = elementwise.then(|| bf16::exchange_in_pieces(send, recv, &mut exchange_f32)).flatten();
        match in_pieces {
            Some(result) => result,
            None => bf16::with_widened(&[send], recv, true, &mut exchange_f32),
        }
    }

    /// Lends `exchange` a collective's send block and receive buffer in their element type: two bf16
    /// buffers go to [`Exchanges::bf16`] as they are (bf16 on the wire, no f32 copies), two f32
    /// buffers to [`Exchanges::f32`]; a bf16 buffer paired with an f32 one is widened as
    /// [`HostArena::exchange_widened`] does.
    pub fn exchange(
        &mut self,
        send: BufferId,
        recv: BufferId,
        elementwise: bool,
        exchange: &mut dyn Exchanges,
    ) -> Result<(), RuntimeError> {
        let elems = (self.region(send)?.elem, self.region(recv)?.elem);
        if elems != (Elem::Bf16, Elem::Bf16) && elems != (Elem::F32, Elem::F32) {
            return self.exchange_widened(send, recv, elementwise, exchange);
        }
        let (ins, mut outs) = self.operands(&[send], &[recv])?;
        let (Some(send), Some(recv)) = (ins.first(), outs.first_mut()) else {
            return Err(unreachable("one send and one receive buffer"));
        };
        match (send.data, &mut recv.data) {
            (ViewData::Bf16(s), ViewMutData::Bf16(r)) => exchange.bf16(s, r),
            (ViewData::F32(s), ViewMutData::F32(r)) => exchange.f32(s, r),
            _ => return Err(unreachable("two buffers of one floating-point type")),
        }
        .map_err(RuntimeError::Comm)
    }

    /// Whether [`HostArena::exchange`] lends these buffers in place (two f32 buffers, or two bf16
    /// ones) rather than widened copies. The words never move while the arena lives (until
    /// [`HostArena::retain`] at the end of a run), so a communicator may keep such blocks past the call.
    pub fn lends_in_place(&self, send: BufferId, recv: BufferId) -> bool {
        let elem = |id| self.region(id).map(|r| r.elem).ok();
        matches!((elem(send), elem(recv)), (Some(Elem::F32), Some(Elem::F32)) | (Some(Elem::Bf16), Some(Elem::Bf16)))
    }

    /// Keeps only the buffers `keep` (disjoint), moved to the front, and gives the rest of the
    /// allocation back; every other buffer loses its place.
    pub fn retain(&mut self, keep: &[BufferId]) -> Result<(), RuntimeError> {
        let mut kept: Vec<BufferId> = keep.to_vec();
        kept.sort_by_key(|id| self.regions.get(id.0 as usize).and_then(Option::as_ref).map(|r| r.offset));
        kept.dedup();
        let (mut cursor, mut end_before) = (0usize, 0usize);
        for id in &kept {
            let (offset, len) = self.region(*id).map(|r| (r.offset, r.len))?;
            if offset < end_before && len > 0 {
                return Err(unreachable("disjoint buffers to keep"));
            }
            end_before = end_before.max(offset + len);
            self.words.copy_within(offset..offset + len, cursor);
            if let Some(r) = self.regions[id.0 as usize].as_mut() {
                r.offset = cursor;
            }
            cursor += len;
        }
        for (k, region) in self.regions.iter_mut().enumerate() {
            if !kept.iter().any(|id| id.0 as usize == k) {
                *region = None;
            }
        }
        self.words.truncate(cursor);
        self.words.shrink_to_fit();
        Ok(())
    }

    /// Disjoint views of one instruction's operands: `reads` (a buffer may repeat) and the buffers in
    /// `writes` (distinct, and none of them read).
    pub fn operands(
        &mut self,
        reads: &[BufferId],
        writes: &[BufferId],
    ) -> Result<(Vec<View<'_>>, Vec<ViewMut<'_>>), RuntimeError> {
        let mut distinct: Vec<BufferId> = writes.to_vec();
        if self.borrowed.iter().any(|(b, _)| writes.contains(b)) {
            return Err(unreachable("no write of a buffer that reads another device's block"));
        }
        for id in reads {
            if writes.contains(id) {
                return Err(RuntimeError::ReadAndWritten { buffer: self.region(*id)?.name.clone() });
            }
            let borrowed = self.borrowed.iter().any(|(b, _)| b == id);
            if !borrowed && !distinct.contains(id) {
                distinct.push(*id);
            }
        }
        let spans =
            distinct.iter().map(|&id| self.region(id).map(|r| (r.offset, r.len))).collect::<Result<Vec<_>, _>>()?;
        let mut slices = carve(&mut self.words, &spans)?.into_iter();
        let region = |id: BufferId| region_of(&self.regions, id);
        let mut outs = Vec::with_capacity(writes.len());
        for &id in writes {
            let slice = slices.next().ok_or_else(|| unreachable("one slice per buffer"))?;
            outs.push(writable_view(region(id)?, slice));
        }
        let shared: Vec<&[f32]> = slices.map(|s| &*s).collect();
        let mut ins = Vec::with_capacity(reads.len());
        for id in reads {
            let r = region(*id)?;
            if let Some((_, block)) = self.borrowed.iter().find(|(b, _)| b == id) {
                // SAFETY: as in `borrowed_words`: alive, unwritten and of the region's size until
                // `end_borrow`.
                ins.push(shared_view(r, unsafe { std::slice::from_raw_parts(block.ptr.cast::<f32>(), r.len) }));
                continue;
            }
            let at =
                distinct[writes.len()..].iter().position(|d| d == id).ok_or_else(|| unreachable("every read kept"))?;
            ins.push(shared_view(r, shared[at]));
        }
        Ok((ins, outs))
    }
}

fn region_of(regions: &[Option<Region>], id: BufferId) -> Result<&Region, RuntimeError> {
    regions.get(id.0 as usize).and_then(Option::as_ref).ok_or(RuntimeError::Storage(StorageError::NoPlace(id)))
}

fn shared_view<'a>(r: &'a Region, words: &'a [f32]) -> View<'a> {
    let data = match r.elem {
        Elem::F32 => ViewData::F32(words),
        Elem::I32 => ViewData::I32(bytemuck::cast_slice(words)),
        Elem::Bf16 => ViewData::Bf16(&bytemuck::cast_slice(words)[..r.elements]),
    };
    View { shape: Shape(&r.shape), data }
}

fn writable_view<'a>(r: &'a Region, words: &'a mut [f32]) -> ViewMut<'a> {
    let data = match r.elem {
        Elem::F32 => ViewMutData::F32(words),
        Elem::I32 => ViewMutData::I32(bytemuck::cast_slice_mut(words)),
        Elem::Bf16 => ViewMutData::Bf16(&mut bytemuck::cast_slice_mut(words)[..r.elements]),
    };
    ViewMut { shape: Shape(&r.shape), data }
}

/// Splits `words` into the regions `(offset, len)` (in the order given), or says which overlap.
/// Empty regions get empty slices wherever they are placed.
pub fn carve<'a>(words: &'a mut [f32], regions: &[(usize, usize)]) -> Result<Vec<&'a mut [f32]>, StorageError> {
    let mut by_offset: Vec<usize> = (0..regions.len()).filter(|&k| regions[k].1 > 0).collect();
    by_offset.sort_by_key(|&k| regions[k].0);
    let mut out: Vec<Option<&'a mut [f32]>> = (0..regions.len()).map(|_| None).collect();
    let (mut rest, mut cursor) = (words, 0usize);
    for k in by_offset {
        let (offset, len) = regions[k];
        if offset < cursor {
            return Err(StorageError::Overlap { start: offset, end: offset + len, before: cursor });
        }
        if offset + len - cursor > rest.len() {
            return Err(StorageError::PastArena { start: offset, end: offset + len });
        }
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(offset - cursor);
        let (slice, tail) = tail.split_at_mut(len);
        out[k] = Some(slice);
        rest = tail;
        cursor = offset + len;
    }
    Ok(out.into_iter().map(|s| s.unwrap_or_default()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carve_hands_out_disjoint_regions_in_the_order_asked() -> Result<(), String> {
        let mut words: Vec<f32> = (0..10).map(|x| x as f32).collect();
        let slices = carve(&mut words, &[(6, 3), (0, 2), (4, 0), (2, 1)]).map_err(|e| e.to_string())?;
        let got: Vec<Vec<f32>> = slices.iter().map(|s| s.to_vec()).collect();
        assert_eq!(got, vec![vec![6.0, 7.0, 8.0], vec![0.0, 1.0], vec![], vec![2.0]]);
        Ok(())
    }

    #[test]
    fn carve_refuses_overlapping_or_outlying_regions() {
        let mut words = vec![0.0f32; 8];
        assert!(carve(&mut words, &[(0, 4), (3, 2)]).is_err());
        assert!(carve(&mut words, &[(6, 4)]).is_err());
    }

    #[test]
    fn best_fit_takes_the_smallest_gap_that_fits_among_overlapping_lifetimes() {
        let during = |start, end| Lifetime { start, end };
        let placed = [(during(0, 9), 0, 16), (during(0, 9), 48, 64), (during(0, 9), 80, 96), (during(20, 30), 16, 48)];
        // Gaps alive during 0..9: 16..48 (32 words) and 64..80 (16 words).
        assert_eq!(best_fit(&placed, during(2, 3), 16, 0), 64);
        assert_eq!(best_fit(&placed, during(2, 3), 32, 0), 16);
        assert_eq!(best_fit(&placed, during(2, 3), 48, 0), 96);
        // During 20..30 only 16..48 is taken.
        assert_eq!(best_fit(&placed, during(25, 26), 16, 0), 0);
    }
}
