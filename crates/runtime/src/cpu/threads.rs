//! The in-process communicator: one thread per device, collectives by rendezvous on shared memory.
//! Every wait has a timeout, and a failed device wakes all others, so a broken run never hangs.

use crate::comm::{
    CollectiveSpec, CommError, Communicator, InPlaceBroadcasts, Payload, RawBlock, Started, combine, reduce_into,
};
use optimus_plan::layout::MESH_AXES;
use optimus_plan::{CollectiveKind, Coords, Group, Mesh};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// One group instance's meeting point: members deposit where their blocks are; once all have, each
/// reads the others' blocks in place, and nobody leaves until everyone has read (so no block changes
/// or goes away while a peer reads it). Nothing is copied but into each member's own result.
#[derive(Default)]
struct Rendezvous {
    state: Mutex<RoundState>,
    ready: Condvar,
    /// Copies of the state's `generation` and `read`, for members that spin before they sleep.
    published: AtomicU64,
    finished: AtomicU64,
}

/// How long a member of a spinning fabric (see [`Fabric::spin_before_sleeping`]) polls before it sleeps.
const SPIN: Duration = Duration::from_micros(200);

impl Rendezvous {
    /// Polls `counter` until it reaches `target`, for at most [`SPIN`] or until a device fails.
    fn spin_until(&self, counter: &AtomicU64, target: u64, failed: &AtomicBool) {
        let start = Instant::now();
        while counter.load(Ordering::Acquire) < target && !failed.load(Ordering::Relaxed) && start.elapsed() < SPIN {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
        }
    }
}

/// Where one member's send block is, and its element size (f32 or bf16). The fabric reads it only
/// between the moment every member has deposited and the moment every member has finished reading,
/// while its owner waits inside [`Fabric::exchange`] holding the borrow it came from.
#[derive(Clone, Copy)]
struct Block {
    ptr: *const u8,
    len: usize,
    bytes_per_element: usize,
}

// SAFETY: a `Block` is only dereferenced while its owner is blocked in `Fabric::exchange` with the
// slice borrowed (see `Block`), so sending the address to the peer threads that read it is sound.
unsafe impl Send for Block {}

impl Block {
    fn of<T: Copy>(data: &[T]) -> Block {
        Block { ptr: data.as_ptr().cast(), len: data.len(), bytes_per_element: size_of::<T>() }
    }

    /// The block as a slice of `T`, or `None` when its owner deposited another element type.
    ///
    /// # Safety
    /// Only while its owner is inside the round that published it (see [`Block`]).
    unsafe fn slice<'a, T: Copy>(self) -> Option<&'a [T]> {
        // SAFETY: the caller guarantees the owner's borrow is alive and unmodified; every member of a
        // round deposits the same element type (a `Payload`, or one descriptor type of `meet`), so the
        // same size means the same type.
        (self.bytes_per_element == size_of::<T>())
            .then(|| unsafe { std::slice::from_raw_parts(self.ptr.cast::<T>(), self.len) })
    }
}

#[derive(Default)]
struct RoundState {
    generation: u64,
    deposits: Vec<Option<Block>>,
    arrived: usize,
    published: Vec<Block>,
    /// Members of the published round still reading its blocks.
    reading: usize,
    /// The last round (generation) whose blocks every member has finished reading.
    read: u64,
}

/// Decrements the count of readers when a member is done with a round, even if reading panicked,
/// and wakes the others when it was the last.
struct ReadDone<'r> {
    rendezvous: &'r Rendezvous,
    generation: u64,
}

impl Drop for ReadDone<'_> {
    fn drop(&mut self) {
        let mut s = match self.rendezvous.state.lock() {
            Ok(s) => s,
            Err(poisoned) => poisoned.into_inner(),
        };
        s.reading = s.reading.saturating_sub(1);
        if s.reading == 0 {
            s.read = self.generation;
            self.rendezvous.finished.store(self.generation, Ordering::Release);
            s.published.clear();
            self.rendezvous.ready.notify_all();
        }
    }
}

/// Shared by all device threads of one run.
pub struct Fabric {
    mesh: Mesh,
    /// One rendezvous per group along each mesh axis, indexed by the rank of the group's first member
    /// (so most slots are unused; they are small).
    axis_groups: [Vec<Rendezvous>; MESH_AXES],
    /// One rendezvous per mirror pair, indexed by the lower of its two ranks.
    mirrors: Vec<Rendezvous>,
    world: Rendezvous,
    failed: AtomicBool,
    failure: Mutex<Option<String>>,
    timeout: Duration,
    /// Bytes of every block deposited so far (what a wire would have carried once per block).
    deposited: AtomicU64,
    /// Whether members poll briefly before they sleep (see [`Fabric::spin_before_sleeping`]).
    spin: AtomicBool,
}

impl Fabric {
    pub fn new(mesh: Mesh, timeout: Duration) -> Arc<Fabric> {
        let make = |_| (0..mesh.devices()).map(|_| Rendezvous::default()).collect::<Vec<_>>();
        Arc::new(Fabric {
            mesh,
            axis_groups: std::array::from_fn(make),
            mirrors: make(0),
            world: Rendezvous::default(),
            failed: AtomicBool::new(false),
            failure: Mutex::new(None),
            timeout,
            deposited: AtomicU64::new(0),
            spin: AtomicBool::new(false),
        })
    }

    /// Makes members poll for up to 200 µs before they sleep on a meeting point. For devices whose
    /// threads only queue work for a GPU (devices sharing one GPU meet twice per collective, and the
    /// GPU idles while they sleep and wake), not for CPU devices, whose waiting threads would take
    /// cores from the others' kernels.
    pub fn spin_before_sleeping(&self) {
        self.spin.store(true, Ordering::Relaxed);
    }

    /// Bytes of the send blocks deposited by every member of every collective so far: 4 an element
    /// for f32 buffers, 2 for bf16 (and the descriptors shared by [`Fabric::meet`]).
    pub fn bytes_deposited(&self) -> u64 {
        self.deposited.load(Ordering::Relaxed)
    }

    /// The first failure reported by any device, if any.
    pub fn failure(&self) -> Option<String> {
        self.failure.lock().ok().and_then(|f| f.clone())
    }

    fn fail(&self, reason: &str) {
        if let Ok(mut f) = self.failure.lock() {
            f.get_or_insert_with(|| reason.to_string());
        }
        self.failed.store(true, Ordering::SeqCst);
        for r in self.axis_groups.iter().flatten().chain(&self.mirrors).chain(std::iter::once(&self.world)) {
            r.ready.notify_all();
        }
    }

    fn rendezvous(&self, group: Group, coords: Coords) -> &Rendezvous {
        if group == Group::Mirror {
            let first = group.member_ranks(coords, self.mesh).first().copied().unwrap_or(0);
            return &self.mirrors[first as usize];
        }
        match group.axis() {
            Some(axis) => {
                let mut first = coords;
                first.0[axis] = 0;
                &self.axis_groups[axis][self.mesh.rank_of(first) as usize]
            }
            None => &self.world,
        }
    }

    /// Deposits `data` as member `me` of `size`, waits for every member's deposit, and calls `read`
    /// with all blocks in member order. Returns once every member has finished its `read`, so `data`
    /// is never read after this returns. `device_of` names a member's device, for the error when some
    /// never arrive.
    fn exchange<T: Copy, R>(
        &self,
        r: &Rendezvous,
        (me, size): (usize, usize),
        data: &[T],
        device_of: &dyn Fn(usize) -> String,
        read: impl FnOnce(&[&[T]]) -> R,
    ) -> Result<R, CommError> {
        let poisoned = || CommError::PeerFailed("a device thread failed while holding a lock".into());
        let mut s = r.state.lock().map_err(|_| poisoned())?;
        if s.deposits.len() != size {
            s.deposits = vec![None; size];
        }
        let generation = s.generation;
        s.deposits[me] = Some(Block::of(data));
        self.deposited.fetch_add(std::mem::size_of_val(data) as u64, Ordering::Relaxed);
        s.arrived += 1;
        if s.arrived == size {
            s.published = s.deposits.iter_mut().filter_map(Option::take).collect();
            s.arrived = 0;
            s.generation += 1;
            r.published.store(s.generation, Ordering::Release);
            s.reading = size;
            r.ready.notify_all();
        }
        if s.generation == generation && self.spin.load(Ordering::Relaxed) {
            drop(s);
            r.spin_until(&r.published, generation + 1, &self.failed);
            s = r.state.lock().map_err(|_| poisoned())?;
        }
        let deadline = Instant::now() + self.timeout;
        while s.generation == generation {
            let now = Instant::now();
            let failure = if self.failed.load(Ordering::SeqCst) {
                Some(CommError::PeerFailed(self.failure().unwrap_or_else(|| "another device failed".into())))
            } else if now >= deadline {
                Some(self.timed_out(&s, size, device_of))
            } else {
                None
            };
            if let Some(failure) = failure {
                // Not published yet: take the deposit back, so that nobody ever reads `data`.
                s.deposits[me] = None;
                s.arrived -= 1;
                return Err(failure);
            }
            s = r.ready.wait_timeout(s, (deadline - now).min(Duration::from_millis(100))).map_err(|_| poisoned())?.0;
        }
        let published = s.published.clone();
        drop(s);
        let result = {
            let _done = ReadDone { rendezvous: r, generation: generation + 1 };
            // SAFETY: every owner of a published block is inside this round until all members have
            // finished reading (the wait below), so the blocks are alive and unchanged.
            let blocks: Option<Vec<&[T]>> = published.iter().map(|b| unsafe { b.slice::<T>() }).collect();
            blocks.map(|blocks| read(&blocks))
        };
        if self.spin.load(Ordering::Relaxed) {
            r.spin_until(&r.finished, generation + 1, &self.failed);
        }
        let mut s = r.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        while s.read < generation + 1 {
            s = r.ready.wait(s).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        result.ok_or(CommError::MixedElements)
    }

    /// Shares one descriptor per member of this device's `group` (where a GPU buffer is, which event
    /// marks it ready): waits for every member's, hands them to `read` in member order, and returns once
    /// every member has read them. Rounds of `meet` and of the host collectives of [`ThreadComm`] share
    /// the group's meeting point, so both must be issued in the same order by every member, as the plan's
    /// instructions are.
    pub fn meet<D: Copy, R>(
        &self,
        group: Group,
        coords: Coords,
        mine: &D,
        read: impl FnOnce(&[&[D]]) -> R,
    ) -> Result<R, CommError> {
        self.exchange_in_group(group, coords, std::slice::from_ref(mine), read)
    }

    /// [`Fabric::exchange`] at the meeting point of the device at `coords`' `group`, as its member; the
    /// members are named (for a timeout) only when one is missing.
    fn exchange_in_group<T: Copy, R>(
        &self,
        group: Group,
        coords: Coords,
        data: &[T],
        read: impl FnOnce(&[&[T]]) -> R,
    ) -> Result<R, CommError> {
        let mesh = self.mesh;
        let size = mesh.group_size_at(group, coords) as usize;
        let me = group.member_index(coords, mesh) as usize;
        let device_of = |m: usize| match group.member_ranks(coords, mesh).get(m) {
            Some(&rank) => mesh.coords_of(rank).to_string(),
            None => format!("member {m}"),
        };
        self.exchange(self.rendezvous(group, coords), (me, size), data, &device_of, read)
    }

    fn timed_out(&self, s: &RoundState, size: usize, device_of: &dyn Fn(usize) -> String) -> CommError {
        let missing: Vec<String> =
            s.deposits.iter().enumerate().filter(|(_, d)| d.is_none()).map(|(m, _)| device_of(m)).collect();
        CommError::TimedOut { seconds: self.timeout.as_secs_f64(), missing, members: size }
    }
}

/// One device's endpoint on a [`Fabric`], with a communication thread of its own once the plan
/// overlaps a collective with computation.
pub struct ThreadComm {
    fabric: Arc<Fabric>,
    coords: Coords,
    /// Started on the first overlapped collective; from then on every collective of this device runs
    /// on it, in the order started, so the device meets its peers in program order.
    worker: Option<Worker>,
}

impl ThreadComm {
    pub fn new(fabric: Arc<Fabric>, coords: Coords) -> ThreadComm {
        ThreadComm { fabric, coords, worker: None }
    }

    /// Collectives started and not yet finished.
    pub fn in_flight(&self) -> usize {
        self.worker.as_ref().map_or(0, Worker::unfinished)
    }
}

/// Runs one collective of this device on the fabric: every member deposits its send block (a
/// broadcast's root alone) and combines the others' in place into its result.
fn exchange_on<T: Payload>(
    fabric: &Fabric,
    coords: Coords,
    spec: &CollectiveSpec<'_>,
    send: &[T],
    recv: &mut [T],
) -> Result<(), CommError> {
    let me = spec.group.member_index(coords, fabric.mesh);
    let members = fabric.mesh.group_size_at(spec.group, coords) as usize;
    let reduces = matches!(spec.kind, CollectiveKind::AllReduce | CollectiveKind::Reduce);
    if reduces && members > 1 && send.len() >= SPLIT_REDUCTION_PER_MEMBER * members {
        return split_reduction(fabric, coords, spec, send, recv);
    }
    // A broadcast only needs the root's block; the others deposit nothing.
    let data = if spec.kind == CollectiveKind::Broadcast && spec.root != Some(me) { &send[..0] } else { send };
    fabric.exchange_in_group(spec.group, coords, data, |parts| combine(spec, me, parts, recv))?
}

/// Reductions of at least this many elements a member are split (see [`split_reduction`]); smaller
/// ones (LayerNorm statistics, a loss) are not worth the extra pointers and copies.
const SPLIT_REDUCTION_PER_MEMBER: usize = 4096;

/// Where one member's blocks of a split reduction are, and their element size.
#[derive(Clone, Copy)]
struct SplitBlocks {
    send: *const u8,
    recv: *mut u8,
    send_len: usize,
    recv_len: usize,
    bytes_per_element: usize,
}

/// An all-reduce or a reduce in one round, split by range: member `m` combines range `m` of every
/// member's send block (in member order, as [`combine`] does) into that range of the result, its own
/// for an all-reduce (then copied into every other member's), the root's for a reduce. Each member
/// reads `len` elements, instead of every member's whole block (an all-reduce) or the root alone
/// reading them all (a reduce); each element is combined as in the unsplit reduction, so the bits are
/// the same.
fn split_reduction<T: Payload>(
    fabric: &Fabric,
    coords: Coords,
    spec: &CollectiveSpec<'_>,
    send: &[T],
    recv: &mut [T],
) -> Result<(), CommError> {
    let me = spec.group.member_index(coords, fabric.mesh) as usize;
    let len = send.len();
    let bytes_per_element = size_of::<T>();
    let mine = SplitBlocks {
        send: send.as_ptr().cast(),
        recv: recv.as_mut_ptr().cast(),
        send_len: len,
        recv_len: recv.len(),
        bytes_per_element,
    };
    // What a wire would carry is the block, not its addresses.
    let carried = size_of_val(send).saturating_sub(size_of::<SplitBlocks>());
    fabric.deposited.fetch_add(carried as u64, Ordering::Relaxed);
    fabric.exchange_in_group(spec.group, coords, std::slice::from_ref(&mine), |parts| {
        let blocks: Vec<SplitBlocks> = parts.iter().filter_map(|p| p.first().copied()).collect();
        if blocks.len() != parts.len() || blocks.iter().any(|b| b.bytes_per_element != bytes_per_element) {
            return Err(CommError::MixedElements);
        }
        let receivers: Vec<usize> = match spec.kind {
            CollectiveKind::Reduce => vec![spec.root.unwrap_or(0) as usize],
            _ => (0..blocks.len()).collect(),
        };
        if let Some(&root) = receivers.iter().find(|&&r| r >= blocks.len()) {
            return Err(CommError::NoSuchRoot(root as u64));
        }
        let short = blocks.iter().map(|b| b.send_len).chain(receivers.iter().map(|&r| blocks[r].recv_len));
        if let Some(sent) = short.into_iter().find(|&l| l != len) {
            return Err(CommError::SizeMismatch { sent, expected: len });
        }
        let range = split_range(len, blocks.len(), me);
        let home = if receivers.contains(&me) { me } else { receivers[0] };
        // SAFETY: every member stays inside this round, its blocks borrowed and otherwise untouched,
        // until all have finished (see `Block`); send blocks are only read, and the members write
        // disjoint ranges of the receive blocks, which no one reads during the round.
        unsafe {
            let sends: Vec<&[T]> = blocks.iter().map(|b| std::slice::from_raw_parts(b.send.cast::<T>(), len)).collect();
            let out = std::slice::from_raw_parts_mut(blocks[home].recv.cast::<T>().add(range.start), range.len());
            reduce_into(&sends, range.start, out, spec.op);
            for &r in receivers.iter().filter(|&&r| r != home) {
                std::ptr::copy_nonoverlapping(out.as_ptr(), blocks[r].recv.cast::<T>().add(range.start), range.len());
            }
        }
        Ok(())
    })?
}

/// Member `me`'s range of `len` elements split over `members`, in whole 16-element runs (cache lines
/// of f32) where it can.
fn split_range(len: usize, members: usize, me: usize) -> std::ops::Range<usize> {
    let each = len.div_ceil(members.max(1)).next_multiple_of(16);
    let start = (me * each).min(len);
    start..(start + each).min(len)
}

impl Communicator for ThreadComm {
    fn coords(&self) -> Coords {
        self.coords
    }

    fn mesh(&self) -> Mesh {
        self.fabric.mesh
    }

    /// Every member deposits its send block (a broadcast's root alone) and combines the others' in place
    /// into its result; bf16 blocks are deposited and read as bf16, reductions taken in f32 and rounded
    /// once. Behind overlapped collectives still in flight, it waits its turn on the device's
    /// communication thread; with none in flight it runs on the caller's thread.
    fn collective<T: Payload>(
        &mut self,
        spec: &CollectiveSpec<'_>,
        send: &[T],
        recv: &mut [T],
    ) -> Result<(), CommError> {
        // With nothing queued on the communication thread, running it here keeps the order and saves
        // two hand-overs between threads.
        if self.in_flight() == 0 {
            return exchange_on(&self.fabric, self.coords, spec, send, recv);
        }
        // SAFETY: both slices stay borrowed (and so untouched by anyone else) until `finish` returns.
        let started = unsafe { self.start(spec, send, recv)? };
        self.finish(started).map(|_| ())
    }

    /// Queues the collective on this device's communication thread (started on first use).
    unsafe fn start<T: Payload>(
        &mut self,
        spec: &CollectiveSpec<'_>,
        send: &[T],
        recv: &mut [T],
    ) -> Result<Started, CommError> {
        let (fabric, coords) = (Arc::clone(&self.fabric), self.coords);
        let owned = OwnedSpec::of(spec);
        let (send, recv) = (Lent::of(send), LentMut::of(recv));
        let job = Box::new(move || {
            // SAFETY: the caller of `start` keeps both blocks allocated and otherwise untouched until
            // `finish` returns for this collective, or until the worker is joined when the endpoint is
            // dropped (see `Worker`), which is after this job has ended.
            let (send, recv) = unsafe { (send.slice(), recv.slice()) };
            exchange_on(&fabric, coords, &owned.spec(), send, recv)
        });
        let worker = match &mut self.worker {
            Some(worker) => worker,
            None => self.worker.insert(Worker::spawn(self.coords)?),
        };
        worker.queue(job).map(Started::Queued)
    }

    fn finish(&mut self, started: Started) -> Result<Duration, CommError> {
        match (started, self.worker.as_mut()) {
            (Started::Done(took), _) => Ok(took),
            (Started::Queued(n), Some(worker)) => worker.finish(n),
            (Started::Queued(n), None) => {
                Err(CommError::Transport(format!("collective {n} was finished on an endpoint that never queued it")))
            }
        }
    }

    fn abort(&self, reason: &str) {
        self.fabric.fail(reason);
    }

    fn in_place_broadcasts(&self) -> Option<Box<dyn InPlaceBroadcasts>> {
        let reader = InPlaceReader { fabric: Arc::clone(&self.fabric), coords: self.coords };
        (self.in_flight() == 0).then(|| Box::new(reader) as Box<dyn InPlaceBroadcasts>)
    }
}

/// A device's broadcasts read in place on a [`Fabric`].
struct InPlaceReader {
    fabric: Arc<Fabric>,
    coords: Coords,
}

impl InPlaceBroadcasts for InPlaceReader {
    /// The root deposits its block's address; every member runs `read` on it inside the round, which
    /// no member leaves before all have finished reading, so the block stays put meanwhile.
    fn broadcast_in_place(
        &self,
        spec: &CollectiveSpec<'_>,
        root_block: Option<RawBlock>,
        read: &mut dyn FnMut(RawBlock),
    ) -> Result<(), CommError> {
        let me = spec.group.member_index(self.coords, self.fabric.mesh);
        let root = spec.root.unwrap_or(0);
        let mine: Vec<RawBlock> = if me == root { root_block.into_iter().collect() } else { Vec::new() };
        // What a wire would carry is the block, not its address.
        let carried = mine.iter().map(|b| b.bytes.saturating_sub(size_of::<RawBlock>())).sum::<usize>();
        self.fabric.deposited.fetch_add(carried as u64, Ordering::Relaxed);
        self.fabric.exchange_in_group(spec.group, self.coords, &mine, |parts| {
            let block = parts.get(root as usize).and_then(|p| p.first()).copied();
            block.map(read).ok_or(CommError::NoSuchRoot(root))
        })?
    }
}

impl Drop for ThreadComm {
    /// A device that stops with collectives in flight (a failure the executor did not report first)
    /// ends its peers' waits, so that its communication thread finishes and can be joined before the
    /// blocks it reads and writes go away.
    fn drop(&mut self) {
        if self.in_flight() > 0 {
            self.fabric.fail(&format!("device {} stopped with collectives in flight", self.coords));
        }
    }
}

/// A collective's description without borrowed parts, for the communication thread: the spec with
/// an empty shape, and the shape beside it.
struct OwnedSpec {
    head: CollectiveSpec<'static>,
    full: Vec<u64>,
}

impl OwnedSpec {
    fn of(spec: &CollectiveSpec<'_>) -> OwnedSpec {
        OwnedSpec { head: CollectiveSpec { full: &[], ..*spec }, full: spec.full.to_vec() }
    }

    fn spec(&self) -> CollectiveSpec<'_> {
        CollectiveSpec { full: &self.full, ..self.head }
    }
}

/// A block lent to the communication thread (see [`Communicator::start`]'s contract).
struct Lent<T> {
    ptr: *const T,
    len: usize,
}

/// A result block lent to the communication thread.
struct LentMut<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: the blocks are payload elements (plain numbers) that only the communication thread uses
// while lent, by `Communicator::start`'s contract.
unsafe impl<T: Payload> Send for Lent<T> {}
unsafe impl<T: Payload> Send for LentMut<T> {}

impl<T> Lent<T> {
    fn of(data: &[T]) -> Lent<T> {
        Lent { ptr: data.as_ptr(), len: data.len() }
    }

    /// # Safety
    /// Only while the lender keeps the block allocated and unwritten.
    unsafe fn slice<'a>(self) -> &'a [T] {
        // SAFETY: by the caller's guarantee.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T> LentMut<T> {
    fn of(data: &mut [T]) -> LentMut<T> {
        LentMut { ptr: data.as_mut_ptr(), len: data.len() }
    }

    /// # Safety
    /// Only while the lender keeps the block allocated and does not touch it.
    unsafe fn slice<'a>(self) -> &'a mut [T] {
        // SAFETY: by the caller's guarantee.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// One collective queued on a communication thread.
type Job = Box<dyn FnOnce() -> Result<(), CommError> + Send>;

/// What a communication thread reports for each collective: its number, its outcome, and how long it
/// ran there.
type Outcome = (u64, Result<(), CommError>, Duration);

/// A device's communication thread: runs queued collectives one after another, in order. It is joined
/// when the endpoint is dropped, after its queue has drained, so no lent block outlives its owner's
/// borrow.
struct Worker {
    jobs: Option<std::sync::mpsc::Sender<(u64, Job)>>,
    outcomes: std::sync::mpsc::Receiver<Outcome>,
    /// Outcomes received before they were asked for.
    finished: std::collections::BTreeMap<u64, (Result<(), CommError>, Duration)>,
    queued: u64,
    waited: u64,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Worker {
    fn spawn(coords: Coords) -> Result<Worker, CommError> {
        let (jobs, queue) = std::sync::mpsc::channel::<(u64, Job)>();
        let (report, outcomes) = std::sync::mpsc::channel::<Outcome>();
        let thread = std::thread::Builder::new()
            .name(format!("comm {coords}"))
            .spawn(move || {
                for (n, job) in queue {
                    let began = Instant::now();
                    let outcome = job();
                    if report.send((n, outcome, began.elapsed())).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| {
                CommError::Transport(format!("cannot start the communication thread of device {coords}: {e}"))
            })?;
        Ok(Worker {
            jobs: Some(jobs),
            outcomes,
            finished: Default::default(),
            queued: 0,
            waited: 0,
            thread: Some(thread),
        })
    }

    fn unfinished(&self) -> usize {
        (self.queued - self.waited) as usize
    }

    fn queue(&mut self, job: Job) -> Result<u64, CommError> {
        let n = self.queued;
        let sent = self.jobs.as_ref().is_some_and(|jobs| jobs.send((n, job)).is_ok());
        if !sent {
            return Err(CommError::Transport("the communication thread has stopped".into()));
        }
        self.queued += 1;
        Ok(n)
    }

    /// Waits for collective `n`; how long it ran on the communication thread.
    fn finish(&mut self, n: u64) -> Result<Duration, CommError> {
        while !self.finished.contains_key(&n) {
            let (k, outcome, took) = self
                .outcomes
                .recv()
                .map_err(|_| CommError::Transport("the communication thread stopped with collectives queued".into()))?;
            self.finished.insert(k, (outcome, took));
        }
        let (outcome, took) = self.finished.remove(&n).unwrap_or((Ok(()), Duration::ZERO));
        self.waited += 1;
        outcome.map(|()| took)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use optimus_plan::ReduceOp;

    fn all_reduce(comm: &mut ThreadComm, value: f32) -> Result<f32, CommError> {
        let mut out = [0.0f32];
        comm.collective(&CollectiveSpec::all_reduce(Group::World, ReduceOp::Sum, &[1]), &[value], &mut out)?;
        Ok(out[0])
    }

    #[test]
    fn all_reduce_sums_over_the_world_many_times() {
        all_reduce_many_times(false);
    }

    #[test]
    fn members_that_spin_before_sleeping_sum_alike() {
        all_reduce_many_times(true);
    }

    fn all_reduce_many_times(spin: bool) {
        let mesh = Mesh::new(2, 2);
        let fabric = Fabric::new(mesh, Duration::from_secs(10));
        if spin {
            fabric.spin_before_sleeping();
        }
        let sums: Vec<f32> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4u64)
                .map(|rank| {
                    let fabric = Arc::clone(&fabric);
                    s.spawn(move || {
                        let mut comm = ThreadComm::new(fabric, Coords::new(rank / 2, rank % 2, 0));
                        (0..50).map(|k| all_reduce(&mut comm, (rank + k) as f32).expect("collective")).sum::<f32>()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        // Each round sums rank + k over 4 ranks: 6 + 4k; over 50 rounds: 300 + 4 * 1225.
        assert!(sums.iter().all(|&s| s == 300.0 + 4.0 * 1225.0), "{sums:?}");
    }

    #[test]
    fn blocks_read_in_place_are_never_read_after_their_owner_reuses_them() {
        // Each member overwrites its send buffer as soon as a collective returns; a peer still reading
        // it would see the garbage and sum wrongly.
        let mesh = Mesh::new(2, 2);
        let fabric = Fabric::new(mesh, Duration::from_secs(10));
        let n = 4096;
        std::thread::scope(|s| {
            for rank in 0..4u64 {
                let fabric = Arc::clone(&fabric);
                s.spawn(move || {
                    let mut comm = ThreadComm::new(fabric, Coords::new(rank / 2, rank % 2, 0));
                    let (mut send, mut recv) = (vec![0.0f32; n], vec![0.0f32; n]);
                    for round in 0..200u64 {
                        send.fill((rank + round) as f32);
                        let (kind, root) = if round % 2 == 0 {
                            (CollectiveKind::AllReduce, None)
                        } else {
                            (CollectiveKind::Broadcast, Some(round % 4))
                        };
                        let full = [n as u64];
                        let spec = CollectiveSpec {
                            kind,
                            root,
                            ..CollectiveSpec::all_reduce(Group::World, ReduceOp::Sum, &full)
                        };
                        comm.collective(&spec, &send, &mut recv).expect("collective");
                        send.fill(f32::NAN);
                        let want = match root {
                            None => (4 * round + 6) as f32,
                            Some(r) => (r + round) as f32,
                        };
                        assert!(recv.iter().all(|&v| v == want), "rank {rank} round {round}: {} != {want}", recv[0]);
                    }
                });
            }
        });
    }

    /// A transpose on a 3x3 grid of two replicas: every device receives the block of its mirror (j, i)
    /// of its own replica, a device on the diagonal its own, round after round, with the blocks of the
    /// last round overwritten as soon as each returns and collectives of rows between them.
    #[test]
    fn a_transpose_hands_each_device_its_mirrors_block() {
        let mesh = Mesh::new(3, 3).with_data(2);
        let fabric = Fabric::new(mesh, Duration::from_secs(10));
        let block = |c: Coords, round: usize| -> Vec<f32> {
            (0..5).map(|k| (mesh.rank_of(c) * 100 + k) as f32 + round as f32 * 0.5).collect()
        };
        std::thread::scope(|s| {
            for rank in 0..mesh.devices() {
                let fabric = Arc::clone(&fabric);
                s.spawn(move || {
                    let c = mesh.coords_of(rank);
                    let mut comm = ThreadComm::new(fabric, c);
                    let spec = CollectiveSpec {
                        kind: CollectiveKind::Transpose,
                        ..CollectiveSpec::all_reduce(Group::Mirror, ReduceOp::Sum, &[5])
                    };
                    let row = CollectiveSpec::all_reduce(Group::Row, ReduceOp::Sum, &[1]);
                    for round in 0..4 {
                        let (mut send, mut recv) = (block(c, round), vec![0.0f32; 5]);
                        comm.collective(&spec, &send, &mut recv).expect("transpose");
                        send.fill(f32::NAN);
                        assert_eq!(recv, block(c.mirrored(), round), "device {c}, round {round}");
                        comm.collective(&row, &[1.0], &mut [0.0]).expect("a row's sum between");
                    }
                });
            }
        });
    }

    /// Member m's block of a large reduction in `round`: values whose f32 sum depends on the order.
    fn large_block(m: usize, round: usize, n: usize) -> Vec<f32> {
        (0..n).map(|k| ((k * 31 + m * 7 + round) % 1009) as f32 * 0.37 - 150.0 + m as f32 * 1e-3).collect()
    }

    /// All-reduces and reduces (`root`) large enough to be split by range (and a length that no
    /// 16-element run divides) give each member the result [`combine`] computes unsplit (a reduce's
    /// other members keep theirs), bit for bit, round after round with the send blocks overwritten as
    /// soon as each returns; a wire carries each block once.
    fn split_reduction_matches_unsplit(mesh: Mesh, group: Group, op: ReduceOp, root: Option<u64>) {
        let members = mesh.devices() as usize;
        let n = SPLIT_REDUCTION_PER_MEMBER * members + 7;
        let fabric = Fabric::new(mesh, Duration::from_secs(10));
        let rounds = 20;
        std::thread::scope(|s| {
            for rank in 0..members {
                let fabric = Arc::clone(&fabric);
                s.spawn(move || {
                    let mut comm = ThreadComm::new(fabric, mesh.coords_of(rank as u64));
                    let me = group.member_index(comm.coords(), mesh) as usize;
                    let full = [n as u64];
                    let kind = if root.is_some() { CollectiveKind::Reduce } else { CollectiveKind::AllReduce };
                    let spec = CollectiveSpec { kind, root, ..CollectiveSpec::all_reduce(group, op, &full) };
                    let (mut recv, mut want) = (vec![-1.0f32; n], vec![-1.0f32; n]);
                    for round in 0..rounds {
                        let mut send = large_block(me, round, n);
                        comm.collective(&spec, &send, &mut recv).expect("reduction");
                        send.fill(f32::NAN);
                        let blocks: Vec<Vec<f32>> = (0..members).map(|m| large_block(m, round, n)).collect();
                        let parts: Vec<&[f32]> = blocks.iter().map(Vec::as_slice).collect();
                        combine(&spec, me as u64, &parts, &mut want).expect("unsplit");
                        assert!(recv == want, "rank {rank} round {round}: split differs from unsplit");
                    }
                    if root.is_some_and(|r| r != me as u64) {
                        assert!(recv.iter().all(|&v| v == -1.0), "a reduce wrote beside its root");
                    }
                });
            }
        });
        assert_eq!(fabric.bytes_deposited(), (rounds * members * n * 4) as u64);
    }

    #[test]
    fn large_reductions_split_by_range_equal_the_unsplit_ones() {
        split_reduction_matches_unsplit(Mesh::new(2, 2), Group::World, ReduceOp::Sum, None);
        split_reduction_matches_unsplit(Mesh::new(1, 3), Group::Row, ReduceOp::Sum, None);
        split_reduction_matches_unsplit(Mesh::new(2, 1), Group::Column, ReduceOp::Max, None);
        split_reduction_matches_unsplit(Mesh::new(2, 2), Group::World, ReduceOp::Sum, Some(2));
        split_reduction_matches_unsplit(Mesh::new(1, 3), Group::Row, ReduceOp::Sum, Some(0));
    }

    #[test]
    fn split_bf16_reductions_sum_in_f32_and_round_once_as_unsplit() {
        let mesh = Mesh::new(1, 2);
        let n = SPLIT_REDUCTION_PER_MEMBER * 2 + 5;
        let fabric = Fabric::new(mesh, Duration::from_secs(10));
        std::thread::scope(|s| {
            for m in 0..2usize {
                let fabric = Arc::clone(&fabric);
                s.spawn(move || {
                    let mut comm = ThreadComm::new(fabric, Coords::new(0, m as u64, 0));
                    let full = [n as u64];
                    let sum = CollectiveSpec::all_reduce(Group::Row, ReduceOp::Sum, &full);
                    for spec in [sum, CollectiveSpec { kind: CollectiveKind::Reduce, root: Some(1), ..sum }] {
                        let send: Vec<u16> = (0..n).map(|k| bf16_value(m, k)).collect();
                        let mut recv = vec![0u16; n];
                        comm.collective(&spec, &send, &mut recv).expect("bf16 reduction");
                        let blocks: Vec<Vec<u16>> =
                            (0..2).map(|p| (0..n).map(|k| bf16_value(p, k)).collect()).collect();
                        let parts: Vec<&[u16]> = blocks.iter().map(Vec::as_slice).collect();
                        let mut want = vec![0u16; n];
                        combine(&spec, m as u64, &parts, &mut want).expect("unsplit");
                        assert!(recv == want, "member {m}, {:?}: split differs from unsplit", spec.kind);
                    }
                });
            }
        });
    }

    #[test]
    fn split_all_reduces_of_unequal_blocks_fail_on_every_member() {
        let mesh = Mesh::new(1, 2);
        let fabric = Fabric::new(mesh, Duration::from_secs(10));
        let n = SPLIT_REDUCTION_PER_MEMBER * 2;
        let results: Vec<Result<(), CommError>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2u64)
                .map(|m| {
                    let fabric = Arc::clone(&fabric);
                    s.spawn(move || {
                        let mut comm = ThreadComm::new(fabric, Coords::new(0, m, 0));
                        let len = n + m as usize * 16;
                        let full = [len as u64];
                        let spec = CollectiveSpec::all_reduce(Group::Row, ReduceOp::Sum, &full);
                        comm.collective(&spec, &vec![1.0f32; len], &mut vec![0.0f32; len])
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        for r in results {
            assert!(matches!(r, Err(CommError::SizeMismatch { .. })), "{r:?}");
        }
    }

    /// Member m's bf16 contribution to element k: values near 1 whose sums rounded at every step
    /// differ from the sum rounded once.
    fn bf16_value(m: usize, k: usize) -> u16 {
        crate::bf16::round(1.0 + ((m * 3 + k) % 11) as f32 * 2f32.powi(-7) - 2f32.powi(-6))
    }

    #[test]
    fn bf16_collectives_carry_two_bytes_an_element_and_sum_in_f32_rounding_once() {
        use crate::bf16::{round, widen_one};
        let mesh = Mesh::new(1, 4);
        let fabric = Fabric::new(mesh, Duration::from_secs(10));
        let n = 3000;
        let results: Vec<(Vec<u16>, Vec<u16>)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4usize)
                .map(|m| {
                    let fabric = Arc::clone(&fabric);
                    s.spawn(move || {
                        let mut comm = ThreadComm::new(fabric, Coords::new(0, m as u64, 0));
                        let send: Vec<u16> = (0..n).map(|k| bf16_value(m, k)).collect();
                        let (mut sum, mut copy) = (vec![0u16; n], vec![0u16; n]);
                        let full = [n as u64];
                        let sum_spec = CollectiveSpec::all_reduce(Group::Row, ReduceOp::Sum, &full);
                        comm.collective(&sum_spec, &send, &mut sum).expect("all-reduce");
                        let copy_spec = CollectiveSpec { kind: CollectiveKind::Broadcast, root: Some(2), ..sum_spec };
                        comm.collective(&copy_spec, &send, &mut copy).expect("broadcast");
                        (sum, copy)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        // Four all-reduce blocks and the broadcast root's block, 2 bytes an element.
        assert_eq!(fabric.bytes_deposited(), (5 * n * 2) as u64);
        let once: Vec<u16> = (0..n).map(|k| round((0..4).map(|m| widen_one(bf16_value(m, k))).sum())).collect();
        let stepwise: Vec<u16> = (0..n)
            .map(|k| (1..4).fold(bf16_value(0, k), |acc, m| round(widen_one(acc) + widen_one(bf16_value(m, k)))))
            .collect();
        assert!(once.iter().zip(&stepwise).any(|(a, b)| a != b), "the values tell one rounding from several");
        for (sum, copy) in &results {
            assert_eq!(sum, &once, "the sum is taken in f32 and rounded once");
            assert!(copy.iter().enumerate().all(|(k, &b)| b == bf16_value(2, k)), "the root's bits");
        }
    }

    #[test]
    fn f32_collectives_carry_four_bytes_an_element() {
        let mesh = Mesh::new(2, 1);
        let fabric = Fabric::new(mesh, Duration::from_secs(10));
        std::thread::scope(|s| {
            for i in 0..2u64 {
                let fabric = Arc::clone(&fabric);
                s.spawn(move || {
                    let mut comm = ThreadComm::new(fabric, Coords::new(i, 0, 0));
                    let (send, mut recv) = ([1.0f32; 10], [0.0f32; 10]);
                    let spec = CollectiveSpec::all_reduce(Group::Column, ReduceOp::Sum, &[10]);
                    comm.collective(&spec, &send, &mut recv).expect("all-reduce");
                    assert_eq!(recv, [2.0; 10]);
                });
            }
        });
        assert_eq!(fabric.bytes_deposited(), 2 * 10 * 4);
    }

    #[test]
    fn started_collectives_run_in_order_beside_the_caller_and_equal_plain_ones() {
        let mesh = Mesh::new(1, 3);
        let fabric = Fabric::new(mesh, Duration::from_secs(60));
        let results: Vec<Result<(f32, f32, f32), CommError>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3u64)
                .map(|j| {
                    let fabric = Arc::clone(&fabric);
                    s.spawn(move || {
                        let mut comm = ThreadComm::new(fabric, Coords::new(0, j, 0));
                        let spec = CollectiveSpec::all_reduce(Group::World, ReduceOp::Sum, &[1]);
                        let (mine, mut first, mut second) = ([j as f32 + 1.0], [0.0f32], [0.0f32]);
                        // SAFETY: every block stays borrowed here, untouched, until its `finish`.
                        let a = unsafe { comm.start(&spec, &mine, &mut first)? };
                        // The second sends the first's result: it runs after the first, on the same thread.
                        let first_ptr: *const [f32] = &first;
                        // SAFETY: `first` is only read by the communication thread until both finish.
                        let b = unsafe { comm.start(&spec, &*first_ptr, &mut second)? };
                        assert_eq!(comm.in_flight(), 2);
                        comm.finish(b)?;
                        comm.finish(a)?;
                        let plain = all_reduce(&mut comm, 1.0)?;
                        Ok((first[0], second[0], plain))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        for r in results {
            assert_eq!(r.expect("no failure"), (6.0, 18.0, 3.0));
        }
    }

    #[test]
    fn a_device_dropped_with_collectives_in_flight_ends_its_peers_waits() {
        let mesh = Mesh::new(1, 2);
        let fabric = Fabric::new(mesh, Duration::from_secs(60));
        let began = Instant::now();
        let peer = std::thread::scope(|s| {
            let lone = Arc::clone(&fabric);
            s.spawn(move || {
                let mut comm = ThreadComm::new(lone, Coords::new(0, 0, 0));
                let spec = CollectiveSpec::all_reduce(Group::World, ReduceOp::Sum, &[1]);
                let (mine, mut out) = ([1.0f32], [0.0f32]);
                // SAFETY: the blocks outlive `comm`, whose drop joins the thread that uses them.
                let _started = unsafe { comm.start(&spec, &mine, &mut out) };
                drop(comm);
            });
            let other = Arc::clone(&fabric);
            s.spawn(move || {
                // The peer arrives at a different collective, which never meets the dropped device's.
                std::thread::sleep(Duration::from_millis(50));
                let mut comm = ThreadComm::new(other, Coords::new(0, 1, 0));
                let mut out = [0.0f32];
                let spec = CollectiveSpec::all_reduce(Group::Row, ReduceOp::Max, &[1]);
                comm.collective(&spec, &[1.0], &mut out)
            })
            .join()
            .expect("thread")
        });
        assert!(began.elapsed() < Duration::from_secs(5), "waited {:?}", began.elapsed());
        assert!(fabric.failure().is_some_and(|f| f.contains("stopped with collectives in flight")), "{peer:?}");
    }

    #[test]
    fn a_failed_device_ends_its_peers_waits_at_once() {
        let mesh = Mesh::new(1, 3);
        let fabric = Fabric::new(mesh, Duration::from_secs(60));
        let start = Instant::now();
        let results: Vec<Result<f32, CommError>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3u64)
                .map(|j| {
                    let fabric = Arc::clone(&fabric);
                    s.spawn(move || {
                        let mut comm = ThreadComm::new(fabric, Coords::new(0, j, 0));
                        if j == 2 {
                            comm.abort("device (0, 2) failed: injected");
                            return Err(CommError::Transport("injected".into()));
                        }
                        all_reduce(&mut comm, 1.0)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        assert!(start.elapsed() < Duration::from_secs(5), "peers waited {:?}", start.elapsed());
        for r in &results[..2] {
            let e = r.as_ref().expect_err("peers of a failed device fail");
            assert!(matches!(e, CommError::PeerFailed(report) if report.contains("device (0, 2)")), "{e}");
        }
    }

    #[test]
    fn a_missing_member_times_out() {
        let mesh = Mesh::new(1, 2);
        let fabric = Fabric::new(mesh, Duration::from_millis(300));
        let mut comm = ThreadComm::new(fabric, Coords::default());
        let e = all_reduce(&mut comm, 1.0).expect_err("nobody else arrives");
        assert!(matches!(&e, CommError::TimedOut { missing, .. } if missing == &["(0, 1)"]), "{e}");
        assert!(e.to_string().contains("timed out"), "{e}");
    }
}
