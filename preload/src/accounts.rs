//! The process's memory accounts: what each live allocation was charged, so that
//! its free credits exactly that, and the charge/credit protocol for every
//! allocation path.
//!
//! Allocation paths are not hot (the design budgets one arbiter round trip per
//! allocation), so the state sits behind one mutex, held across the driver call: a
//! charge, the allocation and its record are one step for the process.
//!
//! Stream-ordered pools keep freed blocks *reserved* (still taken from the device)
//! until a synchronisation or `cuMemPoolTrimTo` trims them. What a pool costs the
//! device is its reserved size, so that is what is charged: before an allocation
//! from a pool, the part of the request its cached bytes cannot cover; after it, the
//! difference to the pool's actual growth; trims are credited when seen (a trim, a
//! free, a memory query, or a refused charge settles the pools).
//!
//! Memory the process uses outside its allocations (context, modules, ...) is not
//! charged here: the arbiter measures it with NVML and charges it to the lease as
//! the process's overhead, so the lease's `used` in every answer includes it. Graph
//! memory nodes are the exception that is settled here too (`graph_launched`):
//! they reserve memory at a graph's launch, and charging it then makes the next
//! charge see it without waiting for a measurement.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::cuda::*;
use crate::lease_link::{LeaseLink, QuotaView, Refusal};
use crate::watch::{self, Reattach};
use gpushare_proto::ShareKey;

/// The arbiter's ledger, as the accounts use it: one round trip per charge, credit or
/// query. `LeaseLink` in the library; a recording stand-in in the unit tests.
pub trait Ledger {
    /// Asks the arbiter for `bytes` more; refused over quota (or unreachable).
    fn charge(&mut self, bytes: u64) -> Result<(), Refusal>;
    fn credit(&mut self, bytes: u64);
    /// What was last heard, if heard less than `max_age` before `now` (no round trip).
    fn heard_within(&self, now: Instant, max_age: Duration) -> Option<QuotaView>;
    /// The lease's share, asked now.
    fn query(&mut self) -> Option<QuotaView>;
    /// Moves `bytes` of the charge to the exported allocation `key` (see
    /// `LeaseLink::share`); false: this process keeps the charge.
    fn share(&mut self, key: ShareKey, bytes: u64, same_as: Option<ShareKey>) -> bool;
    fn hold(&mut self, key: ShareKey);
    fn unhold(&mut self, key: ShareKey);
}

impl Ledger for LeaseLink {
    fn charge(&mut self, bytes: u64) -> Result<(), Refusal> {
        LeaseLink::charge(self, bytes)
    }
    fn credit(&mut self, bytes: u64) {
        LeaseLink::credit(self, bytes);
    }
    fn heard_within(&self, now: Instant, max_age: Duration) -> Option<QuotaView> {
        LeaseLink::heard_within(self, now, max_age)
    }
    fn query(&mut self) -> Option<QuotaView> {
        LeaseLink::query(self)
    }
    fn share(&mut self, key: ShareKey, bytes: u64, same_as: Option<ShareKey>) -> bool {
        LeaseLink::share(self, key, bytes, same_as)
    }
    fn hold(&mut self, key: ShareKey) {
        LeaseLink::hold(self, key);
    }
    fn unhold(&mut self, key: ShareKey) {
        LeaseLink::unhold(self, key);
    }
}

/// What the accounts read from the driver about where memory is: the calling
/// thread's context and device, a pool's and the graph memory pool's reserve.
/// `Driver` in the library; a stand-in in the unit tests.
pub trait DeviceMemory {
    /// The calling thread's current context: where an allocation it makes now lives.
    fn current_context(&self) -> Handle;
    fn current_device(&self) -> Option<CUdevice>;
    /// A stream-ordered pool's (reserved, used) bytes (None: it cannot be read).
    fn pool_usage(&self, pool: Handle) -> Option<(u64, u64)>;
    /// `device`'s graph memory pool's reserved bytes (None: cannot be read).
    fn graph_reserved(&self, device: CUdevice) -> Option<u64>;
}

/// The loaded driver.
#[derive(Debug, Clone, Copy, Default)]
pub struct Driver;

impl DeviceMemory for Driver {
    fn current_context(&self) -> Handle {
        crate::driver::current_context()
    }
    fn current_device(&self) -> Option<CUdevice> {
        crate::driver::current_device()
    }
    fn pool_usage(&self, pool: Handle) -> Option<(u64, u64)> {
        crate::driver::pool_usage(pool)
    }
    fn graph_reserved(&self, device: CUdevice) -> Option<u64> {
        graph_reserved(device)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PoolAccount {
    /// What is charged for this pool (its reserved bytes when last settled).
    charged: u64,
    /// Host-located pools take no device memory.
    host: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Physical {
    bytes: u64,
    released: bool,
    mappings: u32,
    /// Exported (`cuMemExportToShareableHandle`) while the arbiter could not take it
    /// over: another process may map it after this one let go, so it stays charged
    /// here until the process exits.
    exported: bool,
    /// The key the arbiter knows the allocation by, once exported (its charge moved
    /// to the lease) or imported (never charged here): letting go tells the arbiter,
    /// which credits the lease when the last holder has.
    share: Option<ShareKey>,
}

/// How old the lease's share may be when `cuMemGetInfo` (or NVML's memory info)
/// answers from it instead of asking the arbiter. Frameworks poll these in loops
/// (vLLM's profiling, PyTorch's memory stats, a trainer's logging), so a round trip
/// each time would load the arbiter and the lease socket for nothing. Every ledger
/// answer (attach, charge, credit, query) refreshes the share, so this process's
/// own allocations and frees are always in it; what can be up to this old is what
/// *other* processes of the lease did, a re-measured overhead, and pool trims that
/// happened inside the driver. 100 ms is well under the time a framework takes to
/// act on an answer, and the bound is harmless either way: the answer is advice,
/// the charge before each allocation is the enforcement.
pub const VIEW_MAX_AGE: Duration = Duration::from_millis(100);

/// Where a pool allocation came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PoolBlock {
    pool: Handle,
    bytes: u64,
}

pub struct Accounts<L = LeaseLink, D = Driver> {
    pub link: L,
    memory: D,
    /// `cuMemAlloc`, `cuMemAllocPitch`, `cuMemAllocManaged`: pointer → bytes charged.
    device: HashMap<CUdeviceptr, u64>,
    pooled: HashMap<CUdeviceptr, PoolBlock>,
    arrays: HashMap<Handle, u64>,
    mipmapped: HashMap<Handle, u64>,
    pools: HashMap<Handle, PoolAccount>,
    /// Allocations of destroyed pools that are still live: charged per block.
    orphaned_blocks: u64,
    physical: HashMap<PhysicalHandle, Physical>,
    /// VMM mappings of tracked physical allocations: address → (size, handle).
    mappings: BTreeMap<CUdeviceptr, (u64, PhysicalHandle)>,
    /// Exported physical memory this process let go of: still charged (an importer
    /// may map it), credited by the ledger when the process exits.
    exported_released: u64,
    /// Graph memory pools (per device): what is charged for each (its reserved
    /// bytes when last settled).
    graph_pools: HashMap<CUdevice, u64>,
    /// The context each live allocation, array and pool block was made in: destroying
    /// the context (`cuCtxDestroy`, a primary context's reset or last release) frees
    /// them in the driver without a free call of their own.
    made_in: HashMap<Made, Handle>,
}

/// A live allocation, by kind and handle (`Accounts::made_in`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Made {
    Device(CUdeviceptr),
    Array(Handle),
    Mipmapped(Handle),
    Pooled(CUdeviceptr),
}

/// What a driver call that allocates needs from the accounts.
pub type Outcome<T> = Result<T, CUresult>;

impl Accounts {
    pub fn new(link: LeaseLink) -> Accounts {
        Accounts::with(link, Driver)
    }
}

impl<L: Ledger, D: DeviceMemory> Accounts<L, D> {
    pub fn with(link: L, memory: D) -> Accounts<L, D> {
        Accounts {
            link,
            memory,
            device: HashMap::new(),
            pooled: HashMap::new(),
            arrays: HashMap::new(),
            mipmapped: HashMap::new(),
            pools: HashMap::new(),
            orphaned_blocks: 0,
            physical: HashMap::new(),
            mappings: BTreeMap::new(),
            exported_released: 0,
            graph_pools: HashMap::new(),
            made_in: HashMap::new(),
        }
    }

    /// Charges `bytes`; over quota, settles the pools (credits trims nobody has seen
    /// yet) and tries once more.
    pub fn charge(&mut self, bytes: u64, what: &str) -> Outcome<()> {
        match self.link.charge(bytes) {
            Ok(()) => Ok(()),
            Err(Refusal::OverQuota { .. }) if self.settle_all_pools() > 0 => self
                .link
                .charge(bytes)
                .map_err(|r| self.refused(r, bytes, what)),
            Err(r) => Err(self.refused(r, bytes, what)),
        }
    }

    fn refused(&self, refusal: Refusal, bytes: u64, what: &str) -> CUresult {
        match refusal {
            Refusal::OverQuota {
                used,
                quota,
                overhead,
            } => crate::log_info!(
                "{what} of {bytes} bytes refused: the lease uses {used} of its {quota} bytes, {overhead} of them its processes' own overhead (CUDA contexts, modules)"
            ),
            other => crate::log_info!("{what} of {bytes} bytes refused: {other:?}"),
        }
        CUDA_ERROR_OUT_OF_MEMORY
    }

    pub fn credit(&mut self, bytes: u64) {
        self.link.credit(bytes);
    }

    // ----- plain device allocations -----

    /// Charge, allocate, record; a failed allocation is credited back.
    pub fn allocate_device(
        &mut self,
        bytes: u64,
        what: &str,
        allocate: impl FnOnce() -> Outcome<CUdeviceptr>,
    ) -> CUresult {
        if let Err(rc) = self.charge(bytes, what) {
            return rc;
        }
        match allocate() {
            Ok(ptr) => {
                self.device.insert(ptr, bytes);
                self.made_in
                    .insert(Made::Device(ptr), self.memory.current_context());
                CUDA_SUCCESS
            }
            Err(rc) => {
                self.credit(bytes);
                rc
            }
        }
    }

    /// `cuMemAllocPitch`: the driver picks the pitch, so an estimate is charged first
    /// and corrected to the real pitch × height after; if the real size does not fit,
    /// the allocation is freed and refused.
    pub fn allocate_pitched(
        &mut self,
        estimate: u64,
        allocate: impl FnOnce() -> Outcome<(CUdeviceptr, u64)>,
        free: impl FnOnce(CUdeviceptr),
    ) -> CUresult {
        if let Err(rc) = self.charge(estimate, "cuMemAllocPitch") {
            return rc;
        }
        let (ptr, actual) = match allocate() {
            Ok(v) => v,
            Err(rc) => {
                self.credit(estimate);
                return rc;
            }
        };
        if actual > estimate {
            if let Err(rc) = self.charge(actual - estimate, "cuMemAllocPitch (real pitch)") {
                free(ptr);
                self.credit(estimate);
                return rc;
            }
        } else {
            self.credit(estimate - actual);
        }
        self.device.insert(ptr, actual);
        self.made_in
            .insert(Made::Device(ptr), self.memory.current_context());
        CUDA_SUCCESS
    }

    /// After a successful `cuMemFree`: credit what the pointer was charged.
    pub fn freed(&mut self, ptr: CUdeviceptr) {
        if let Some(bytes) = self.device.remove(&ptr) {
            self.made_in.remove(&Made::Device(ptr));
            self.credit(bytes);
        } else if self.pooled.contains_key(&ptr) {
            self.freed_to_pool(ptr);
        }
    }

    // ----- arrays -----

    pub fn allocate_array(
        &mut self,
        mipmapped: bool,
        bytes: u64,
        allocate: impl FnOnce() -> Outcome<Handle>,
    ) -> CUresult {
        let what = if mipmapped {
            "cuMipmappedArrayCreate"
        } else {
            "cuArrayCreate"
        };
        if let Err(rc) = self.charge(bytes, what) {
            return rc;
        }
        match allocate() {
            Ok(handle) => {
                let map = if mipmapped {
                    &mut self.mipmapped
                } else {
                    &mut self.arrays
                };
                map.insert(handle, bytes);
                let made = if mipmapped {
                    Made::Mipmapped(handle)
                } else {
                    Made::Array(handle)
                };
                self.made_in.insert(made, self.memory.current_context());
                CUDA_SUCCESS
            }
            Err(rc) => {
                self.credit(bytes);
                rc
            }
        }
    }

    pub fn array_destroyed(&mut self, mipmapped: bool, handle: Handle) {
        let map = if mipmapped {
            &mut self.mipmapped
        } else {
            &mut self.arrays
        };
        if let Some(bytes) = map.remove(&handle) {
            self.made_in.remove(&if mipmapped {
                Made::Mipmapped(handle)
            } else {
                Made::Array(handle)
            });
            self.credit(bytes);
        }
    }

    // ----- stream-ordered pools -----

    pub fn pool_created(&mut self, pool: Handle, host: bool) {
        self.pools.insert(pool, PoolAccount { charged: 0, host });
    }

    fn pool_account(&mut self, pool: Handle) -> &mut PoolAccount {
        // Pools nobody created through us (each device's default pool) are device pools.
        self.pools.entry(pool).or_insert(PoolAccount {
            charged: 0,
            host: false,
        })
    }

    /// Brings the pool's charge to its reserved size; returns the bytes credited.
    fn settle_pool(&mut self, pool: Handle, usage: Option<(u64, u64)>) -> u64 {
        let Some((reserved, _)) = usage else { return 0 };
        let account = *self.pool_account(pool);
        if account.host {
            return 0;
        }
        if reserved < account.charged {
            self.credit(account.charged - reserved);
            self.pool_account(pool).charged = reserved;
            account.charged - reserved
        } else {
            if reserved > account.charged && self.link.charge(reserved - account.charged).is_ok() {
                // Growth we did not cause (e.g. graph memory nodes): charged when seen.
                self.pool_account(pool).charged = reserved;
            }
            0
        }
    }

    /// Settles every device pool; returns the bytes credited.
    pub fn settle_all_pools(&mut self) -> u64 {
        let pools: Vec<Handle> = self
            .pools
            .iter()
            .filter(|(_, a)| !a.host)
            .map(|(p, _)| *p)
            .collect();
        pools
            .into_iter()
            .map(|p| self.settle_pool(p, self.memory.pool_usage(p)))
            .sum()
    }

    /// An allocation from `pool`. `usage` reads the pool's (reserved, used) bytes;
    /// `free` gives a block back (stream-ordered) and trims the pool to a size.
    pub fn allocate_from_pool(
        &mut self,
        pool: Handle,
        bytes: u64,
        usage: impl Fn() -> Option<(u64, u64)>,
        allocate: impl FnOnce() -> Outcome<CUdeviceptr>,
        give_back: impl FnOnce(CUdeviceptr, u64),
    ) -> CUresult {
        if self.pool_account(pool).host {
            return allocate().err().unwrap_or(CUDA_SUCCESS);
        }
        let before = usage();
        self.settle_pool(pool, before);
        let cached = before.map_or(0, |(reserved, used)| reserved.saturating_sub(used));
        let provisional = bytes.saturating_sub(cached);
        if let Err(rc) = self.charge(provisional, "cuMemAllocAsync") {
            return rc;
        }
        let ptr = match allocate() {
            Ok(ptr) => ptr,
            Err(rc) => {
                self.credit(provisional);
                return rc;
            }
        };
        let charged = self.pool_account(pool).charged + provisional;
        let reserved = usage().map_or(charged, |(reserved, _)| reserved);
        if reserved > charged {
            // The pool grew more than its cache suggested (fragmentation).
            if let Err(rc) = self.charge(reserved - charged, "cuMemAllocAsync (pool growth)") {
                give_back(ptr, charged);
                self.credit(provisional);
                let after = usage();
                self.settle_pool(pool, after);
                return rc;
            }
        } else if reserved < charged {
            self.credit(charged - reserved);
        }
        self.pool_account(pool).charged = reserved;
        self.pooled.insert(ptr, PoolBlock { pool, bytes });
        self.made_in
            .insert(Made::Pooled(ptr), self.memory.current_context());
        CUDA_SUCCESS
    }

    /// After a successful stream-ordered free (or a `cuMemFree` of pool memory).
    pub fn freed_to_pool(&mut self, ptr: CUdeviceptr) {
        let Some(block) = self.pooled.remove(&ptr) else {
            // cuMemFreeAsync of a cuMemAlloc pointer is legal too.
            if let Some(bytes) = self.device.remove(&ptr) {
                self.made_in.remove(&Made::Device(ptr));
                self.credit(bytes);
            }
            return;
        };
        self.made_in.remove(&Made::Pooled(ptr));
        if self.pools.contains_key(&block.pool) {
            // The block stays reserved in its pool until a trim: settle in case the
            // driver released it already.
            self.settle_pool(block.pool, self.memory.pool_usage(block.pool));
        } else {
            // Its pool was destroyed: the block held the device on its own.
            self.orphaned_blocks = self.orphaned_blocks.saturating_sub(block.bytes);
            self.credit(block.bytes);
        }
    }

    pub fn pool_trimmed(&mut self, pool: Handle) {
        self.settle_pool(pool, self.memory.pool_usage(pool));
    }

    /// `used_before`: the pool's bytes in use just before it was destroyed; those
    /// blocks stay allocated (each is credited when freed), the cache went back.
    pub fn pool_destroyed(&mut self, pool: Handle, used_before: Option<u64>) {
        let Some(account) = self.pools.remove(&pool) else {
            return;
        };
        if account.host {
            return;
        }
        let live: u64 = self
            .pooled
            .values()
            .filter(|b| b.pool == pool)
            .map(|b| b.bytes)
            .sum();
        let keep = used_before.unwrap_or(live).min(account.charged);
        self.credit(account.charged - keep);
        self.orphaned_blocks += keep;
    }

    // ----- virtual memory management -----

    pub fn create_physical(
        &mut self,
        bytes: u64,
        allocate: impl FnOnce() -> Outcome<PhysicalHandle>,
    ) -> CUresult {
        if let Err(rc) = self.charge(bytes, "cuMemCreate") {
            return rc;
        }
        match allocate() {
            Ok(handle) => {
                self.physical.insert(
                    handle,
                    Physical {
                        bytes,
                        released: false,
                        mappings: 0,
                        exported: false,
                        share: None,
                    },
                );
                CUDA_SUCCESS
            }
            Err(rc) => {
                self.credit(bytes);
                rc
            }
        }
    }

    /// The driver frees a physical allocation once it is released *and* unmapped
    /// everywhere (the usual idiom releases right after mapping): credit then.
    /// An exported allocation may live on in an importer that maps it, and the
    /// exporter cannot see that: it stays charged to the exporter (the one that
    /// allocated it, as NVML counts it) until the exporter's connection closes.
    fn credit_physical_if_gone(&mut self, handle: PhysicalHandle) {
        if let Some(p) = self.physical.get(&handle).copied() {
            if p.released && p.mappings == 0 {
                self.physical.remove(&handle);
                if let Some(key) = p.share {
                    self.link.unhold(key);
                } else if p.exported {
                    self.exported_released += p.bytes;
                } else {
                    self.credit(p.bytes);
                }
            }
        }
    }

    /// After a successful `cuMemExportToShareableHandle` of `handle`; `key`: the
    /// shareable descriptor's identity (None: not a descriptor, or unreadable). The
    /// memory lives while any process holds it, so its charge moves to the lease,
    /// which keeps it until the last holder lets go, this process's exit included;
    /// where the arbiter cannot take it, this process keeps it until it exits.
    pub fn physical_exported(&mut self, handle: PhysicalHandle, key: Option<ShareKey>) {
        let Some(p) = self.physical.get(&handle).copied() else {
            return;
        };
        let moved = match (key, p.share) {
            (Some(key), None) => self.link.share(key, p.bytes, None).then_some(key),
            (Some(key), Some(first)) => {
                self.link.share(key, 0, Some(first));
                Some(first)
            }
            (None, share) => share,
        };
        if let Some(p) = self.physical.get_mut(&handle) {
            p.share = moved;
            p.exported = moved.is_none();
        }
    }

    /// After a successful `cuMemImportFromShareableHandle`: another process's
    /// allocation, charged to its lease (never here), which this process now holds.
    pub fn physical_imported(&mut self, handle: PhysicalHandle, key: ShareKey) {
        self.physical.insert(
            handle,
            Physical {
                bytes: 0,
                released: false,
                mappings: 0,
                exported: false,
                share: Some(key),
            },
        );
        self.link.hold(key);
    }

    /// Exported memory this process released and still pays for.
    pub fn exported_released(&self) -> u64 {
        self.exported_released
    }

    pub fn physical_released(&mut self, handle: PhysicalHandle) {
        if let Some(p) = self.physical.get_mut(&handle) {
            p.released = true;
            self.credit_physical_if_gone(handle);
        }
    }

    pub fn mapped(&mut self, address: CUdeviceptr, size: u64, handle: PhysicalHandle) {
        if let Some(p) = self.physical.get_mut(&handle) {
            p.mappings += 1;
            self.mappings.insert(address, (size, handle));
        }
    }

    pub fn unmapped(&mut self, address: CUdeviceptr, size: u64) {
        let end = address.saturating_add(size);
        let inside: Vec<CUdeviceptr> = self.mappings.range(address..end).map(|(a, _)| *a).collect();
        for a in inside {
            if let Some((_, handle)) = self.mappings.remove(&a) {
                if let Some(p) = self.physical.get_mut(&handle) {
                    p.mappings = p.mappings.saturating_sub(1);
                }
                self.credit_physical_if_gone(handle);
            }
        }
    }

    // ----- contexts -----

    /// `context` was destroyed (`cuCtxDestroy`, or `device`'s primary context reset or
    /// released for the last time): the driver freed everything made in it without a
    /// free call of its own, so credit it — or the ledger keeps charging memory that is
    /// gone, and later allocations are refused for a quota that is not used.
    /// A `reset` cleans up the device's pools too ("destroys and cleans up all
    /// resources associated with the current device in the current process", cuda.h):
    /// what their reserve gave back is credited when settled, and a pool that can no
    /// longer be read is credited whole. VMM memory (`cuMemCreate`) is the process's,
    /// not the context's, and is left to its release.
    pub fn context_gone(&mut self, context: Handle, device: Option<CUdevice>, reset: bool) {
        let gone: Vec<Made> = self
            .made_in
            .iter()
            .filter(|(_, c)| **c == context)
            .map(|(m, _)| *m)
            .collect();
        let mut freed = 0u64;
        for made in gone {
            self.made_in.remove(&made);
            freed += match made {
                Made::Device(ptr) => self.device.remove(&ptr).unwrap_or(0),
                Made::Array(handle) => self.arrays.remove(&handle).unwrap_or(0),
                Made::Mipmapped(handle) => self.mipmapped.remove(&handle).unwrap_or(0),
                Made::Pooled(ptr) => match self.pooled.remove(&ptr) {
                    // A block of a live pool is part of the pool's reserve: settled below.
                    Some(block) if self.pools.contains_key(&block.pool) => 0,
                    // Its pool was destroyed: the block held the device on its own.
                    Some(block) => {
                        self.orphaned_blocks = self.orphaned_blocks.saturating_sub(block.bytes);
                        block.bytes
                    }
                    None => 0,
                },
            };
        }
        if reset {
            let unreadable: Vec<Handle> = self
                .pools
                .iter()
                .filter(|(p, a)| !a.host && self.memory.pool_usage(**p).is_none())
                .map(|(p, _)| *p)
                .collect();
            for pool in unreadable {
                if let Some(account) = self.pools.remove(&pool) {
                    freed += account.charged;
                }
                self.pooled.retain(|_, b| b.pool != pool);
            }
        }
        self.credit(freed);
        self.settle_all_pools();
        if let Some(device) = device {
            self.settle_graph_pool(device, self.memory.graph_reserved(device));
        }
    }

    // ----- graph memory nodes -----

    /// Brings the charge for `device`'s graph memory pool to its reserved size
    /// (`reserved`: None when it cannot be read). Growth is charged when seen; a
    /// growth the quota refuses stays uncharged here, and the arbiter's NVML
    /// measurement counts it as the process's overhead instead (nothing is
    /// counted twice: that measurement subtracts what was charged). Shrinking
    /// (`cuDeviceGraphMemTrim`) is credited.
    pub fn settle_graph_pool(&mut self, device: CUdevice, reserved: Option<u64>) {
        let Some(reserved) = reserved else { return };
        let charged = self.graph_pools.get(&device).copied().unwrap_or(0);
        if reserved < charged {
            self.credit(charged - reserved);
            self.graph_pools.insert(device, reserved);
        } else if reserved > charged && self.link.charge(reserved - charged).is_ok() {
            self.graph_pools.insert(device, reserved);
        }
    }

    /// Before launching a graph whose allocation nodes will grow `device`'s graph
    /// memory pool to `prospective` bytes: charges the growth over what the pool is
    /// charged now, so a launch past the quota is refused before anything runs (the
    /// driver reserves the pool's memory inside `cuGraphLaunch`, with no later chance
    /// to refuse). The launch's settle brings the charge to the pool's real size.
    pub fn reserve_graph_pool(&mut self, device: CUdevice, prospective: u64) -> Outcome<()> {
        let charged = self.graph_pools.get(&device).copied().unwrap_or(0);
        if prospective > charged {
            self.charge(prospective - charged, "graph memory pool growth")?;
            self.graph_pools.insert(device, prospective);
        }
        Ok(())
    }

    fn settle_graph_pools(&mut self) {
        let devices: Vec<CUdevice> = self.graph_pools.keys().copied().collect();
        for device in devices {
            self.settle_graph_pool(device, self.memory.graph_reserved(device));
        }
    }

    // ----- queries -----

    /// The lease's share now, after crediting pool trims nobody has seen yet.
    pub fn view(&mut self) -> Option<QuotaView> {
        self.view_at(Instant::now())
    }

    /// The share as of `now`: what was last heard if younger than `VIEW_MAX_AGE`
    /// (no round trip), else settled pools and a fresh query.
    pub fn view_at(&mut self, now: Instant) -> Option<QuotaView> {
        if let Some(view) = self.link.heard_within(now, VIEW_MAX_AGE) {
            return Some(view);
        }
        self.settle_all_pools();
        self.settle_graph_pools();
        if let Some(device) = self.memory.current_device() {
            if !self.graph_pools.contains_key(&device) {
                self.settle_graph_pool(device, self.memory.graph_reserved(device));
            }
        }
        self.link.query()
    }
}

// ----- graph memory, read from the driver -----

/// `CUgraphMem_attribute`: what the device's graph memory pool has in use and what it
/// holds from the device.
pub(crate) const GRAPH_MEM_ATTR_USED_MEM_CURRENT: libc::c_int = 0;
pub(crate) const GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT: libc::c_int = 2;

static GRAPH_MEM_ATTRIBUTE: AtomicPtr<libc::c_void> = AtomicPtr::new(std::ptr::null_mut());

/// The driver's function `name`, looked up once into `slot` (None: this driver has none).
pub(crate) fn driver_function(
    slot: &AtomicPtr<libc::c_void>,
    name: &std::ffi::CStr,
) -> Option<*mut libc::c_void> {
    let mut f = slot.load(Ordering::Acquire);
    if f.is_null() {
        f = crate::loader::find_in_driver(crate::variants::Library::Cuda, name)?;
        slot.store(f, Ordering::Release);
    }
    Some(f)
}

/// The graph memory pool's reserved bytes on `device` (None: the driver has no
/// `cuDeviceGetGraphMemAttribute`, before CUDA 11.4, or it failed).
fn graph_reserved(device: CUdevice) -> Option<u64> {
    graph_mem_attribute(device, GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT)
}

/// A `cuuint64_t` attribute of `device`'s graph memory pool (`CUgraphMem_attribute`).
pub(crate) fn graph_mem_attribute(device: CUdevice, attribute: libc::c_int) -> Option<u64> {
    let f = driver_function(&GRAPH_MEM_ATTRIBUTE, c"cuDeviceGetGraphMemAttribute")?;
    type GetAttr = unsafe extern "C" fn(CUdevice, libc::c_int, *mut libc::c_void) -> CUresult;
    let mut value: u64 = 0;
    // SAFETY: cuDeviceGetGraphMemAttribute(device, attr, void*): the *_MEM_CURRENT
    // attributes are cuuint64_t.
    let rc = unsafe {
        std::mem::transmute::<*mut libc::c_void, GetAttr>(f)(
            device,
            attribute,
            (&mut value as *mut u64).cast(),
        )
    };
    (rc == CUDA_SUCCESS).then_some(value)
}

/// Call after a successful `cuGraphLaunch` (any variant): a graph with memory
/// nodes reserves its memory at launch, from the device's graph memory pool,
/// which no allocation call of ours sees. Settles the current device's graph pool
/// charge. Cheap when nothing changed: two driver attribute reads and an
/// uncontended lock, no round trip. Never waits for the accounts: another thread
/// may hold them across a synchronising driver call (`cuMemFree`), and a launch
/// path must not queue behind that; a settle skipped here is done by the next
/// memory query, and the arbiter's NVML measurement counts the memory meanwhile.
pub fn graph_launched() {
    if !crate::config::is_active() {
        return;
    }
    let Some(device) = crate::driver::current_device() else {
        return;
    };
    let reserved = graph_reserved(device);
    let Some(m) = instance() else { return };
    let mut a = match m.try_lock() {
        Ok(a) => a,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return,
    };
    a.settle_graph_pool(device, reserved);
}

// ----- the process's one instance -----

/// The accounts of this process. A pointer rather than a `static Mutex` so that a
/// fork child can abandon its parent's (whose lock another parent thread may have
/// held at the fork) without touching it; the abandoned copy is leaked, never used.
static CURRENT: AtomicPtr<Mutex<Accounts>> = AtomicPtr::new(std::ptr::null_mut());

fn instance() -> Option<&'static Mutex<Accounts>> {
    let current = CURRENT.load(Ordering::Acquire);
    if !current.is_null() {
        // SAFETY: every pointer stored in CURRENT comes from Box::leak and is never freed.
        return Some(unsafe { &*current });
    }
    let socket = crate::config::get()?.socket.clone();
    let fresh = Box::into_raw(Box::new(Mutex::new(Accounts::new(LeaseLink::for_process(
        socket,
        reattach_step,
    )))));
    match CURRENT.compare_exchange(
        std::ptr::null_mut(),
        fresh,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        // SAFETY: just leaked above; never freed.
        Ok(_) => Some(unsafe { &*fresh }),
        Err(winner) => {
            // SAFETY: `fresh` was never shared; `winner` was leaked by another thread.
            unsafe {
                drop(Box::from_raw(fresh));
                Some(&*winner)
            }
        }
    }
}

/// The locked accounts, or `None` when the library is inert.
pub fn lock() -> Option<MutexGuard<'static, Accounts>> {
    if !crate::config::is_active() {
        return None;
    }
    let m = instance()?;
    Some(m.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
}

/// The watcher's step: under the accounts' lock, one re-attach attempt with what the
/// process holds.
fn reattach_step() -> Option<Reattach> {
    lock().map(|mut a| a.link.reattach_once())
}

/// After the process's first context was created (`cuDevicePrimaryCtxRetain`,
/// `cuCtxCreate*`, `cuGreenCtxCreate`): attach to the lease with what it holds (nothing, usually), so the
/// arbiter's watchdog, which sees the process in NVML from its context on, finds it
/// registered — not only from its first allocation (it was reported, and with
/// `watchdog_kill` killed, in between). After, not before: the arbiter measures a new
/// client's overhead (its context) in NVML right after it attaches, and a process
/// measured before its context existed was charged nothing for it until the next
/// measurement, so its first `cuMemGetInfo` offered the context's memory too. Once per
/// process: from then on the watcher keeps it attached, and retries in the background
/// if the arbiter could not be reached now.
pub fn attach_after_context_creation() {
    if !crate::config::is_active() || watch::started() {
        return;
    }
    if let Some(mut a) = lock() {
        if !a.link.is_connected() {
            a.link.connect(crate::lease_link::QUERY_PATIENCE);
        }
    }
    watch::start(reattach_step);
}

/// Fork child: drop the parent's accounts and connection (see `fork`).
pub fn forget_after_fork() {
    CURRENT.store(std::ptr::null_mut(), Ordering::Release);
    crate::lease_link::close_inherited_connection();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A recording stand-in for the arbiter's ledger: one lease of `quota` bytes of
    /// which `overhead` is the process's own (measured by the arbiter), as the
    /// arbiter's ledger answers; counts the queries.
    struct FakeLedger {
        quota: u64,
        overhead: u64,
        held: u64,
        queries: usize,
        heard: Option<QuotaView>,
        /// Whether the arbiter takes exported allocations; what it was told of them.
        arbiter_shares: bool,
        holds: Vec<(&'static str, ShareKey)>,
    }

    impl FakeLedger {
        fn view(&self) -> QuotaView {
            QuotaView {
                quota: self.quota,
                used: self.held + self.overhead,
                overhead: self.overhead,
                gpus: 1,
                released: false,
            }
        }
        fn held(&self) -> u64 {
            self.held
        }
    }

    impl Ledger for FakeLedger {
        fn charge(&mut self, bytes: u64) -> Result<(), Refusal> {
            let used = self.held + self.overhead;
            if used + bytes > self.quota {
                return Err(Refusal::OverQuota {
                    used,
                    quota: self.quota,
                    overhead: self.overhead,
                });
            }
            self.held += bytes;
            Ok(())
        }
        fn credit(&mut self, bytes: u64) {
            self.held -= bytes;
        }
        fn heard_within(&self, _: Instant, _: Duration) -> Option<QuotaView> {
            self.heard
        }
        fn query(&mut self) -> Option<QuotaView> {
            self.queries += 1;
            Some(self.view())
        }
        fn share(&mut self, key: ShareKey, bytes: u64, _: Option<ShareKey>) -> bool {
            if self.arbiter_shares {
                self.held -= bytes;
                self.holds.push(("share", key));
            }
            self.arbiter_shares
        }
        fn hold(&mut self, key: ShareKey) {
            self.holds.push(("hold", key));
        }
        fn unhold(&mut self, key: ShareKey) {
            self.holds.push(("unhold", key));
        }
    }

    /// The driver as the tests set it: everything made in context 0, pools read from
    /// `pools`, a graph memory pool on device 0 when `graph` is set.
    #[derive(Default)]
    struct FakeMemory {
        pools: std::cell::RefCell<HashMap<Handle, (u64, u64)>>,
        graph: Cell<Option<u64>>,
    }

    impl DeviceMemory for FakeMemory {
        fn current_context(&self) -> Handle {
            0
        }
        fn current_device(&self) -> Option<CUdevice> {
            Some(0)
        }
        fn pool_usage(&self, pool: Handle) -> Option<(u64, u64)> {
            self.pools.borrow().get(&pool).copied()
        }
        fn graph_reserved(&self, _: CUdevice) -> Option<u64> {
            self.graph.get()
        }
    }

    fn accounts_with(quota: u64, overhead: u64) -> Accounts<FakeLedger, FakeMemory> {
        let ledger = FakeLedger {
            quota,
            overhead,
            held: 0,
            queries: 0,
            heard: None,
            arbiter_shares: false,
            holds: Vec::new(),
        };
        Accounts::with(ledger, FakeMemory::default())
    }

    fn accounts(quota: u64) -> Accounts<FakeLedger, FakeMemory> {
        accounts_with(quota, 0)
    }

    #[test]
    fn pitched_allocation_is_corrected_to_the_real_pitch() {
        let mut a = accounts(10_000);
        // Estimate 1000, driver chose 1200: 200 more charged.
        assert_eq!(
            a.allocate_pitched(1000, || Ok((7, 1200)), |_| panic!("kept")),
            CUDA_SUCCESS
        );
        assert_eq!(a.link.held(), 1200);
        // Estimate 1000, driver chose 800: 200 credited.
        assert_eq!(
            a.allocate_pitched(1000, || Ok((8, 800)), |_| panic!("kept")),
            CUDA_SUCCESS
        );
        assert_eq!(a.link.held(), 2000);
        // Real size beyond the quota: freed and refused, nothing left charged.
        let mut freed = None;
        let rc = a.allocate_pitched(1000, || Ok((9, 9000)), |p| freed = Some(p));
        assert_eq!(
            (rc, freed, a.link.held()),
            (CUDA_ERROR_OUT_OF_MEMORY, Some(9), 2000)
        );
        a.freed(7);
        a.freed(8);
        assert_eq!(a.link.held(), 0);
    }

    #[test]
    fn pool_charges_growth_not_cached_reuse() {
        let mut a = accounts(1000);
        let pool = 5;
        // Empty pool, 600 requested: grows by 600.
        let usage = std::cell::Cell::new((0u64, 0u64));
        let rc = a.allocate_from_pool(
            pool,
            600,
            || Some(usage.get()),
            || {
                usage.set((600, 600));
                Ok(1)
            },
            |_, _| panic!(),
        );
        assert_eq!((rc, a.link.held()), (CUDA_SUCCESS, 600));
        // Freed into the pool: still reserved, still charged.
        usage.set((600, 0));
        a.pooled.remove(&1);
        // 600 more from the cache: no growth, no charge, although 1200 > quota.
        let rc = a.allocate_from_pool(
            pool,
            600,
            || Some(usage.get()),
            || {
                usage.set((600, 600));
                Ok(2)
            },
            |_, _| panic!(),
        );
        assert_eq!((rc, a.link.held()), (CUDA_SUCCESS, 600));
        // Beyond: refused before the driver is called.
        let rc = a.allocate_from_pool(
            pool,
            500,
            || Some(usage.get()),
            || panic!("not called"),
            |_, _| panic!(),
        );
        assert_eq!(rc, CUDA_ERROR_OUT_OF_MEMORY);
        // A trim seen later is credited.
        usage.set((0, 0));
        a.pooled.clear();
        assert_eq!(a.settle_pool(pool, Some(usage.get())), 600);
        assert_eq!(a.link.held(), 0);
    }

    #[test]
    fn physical_memory_is_credited_after_release_and_unmap() {
        let mut a = accounts(1 << 30);
        assert_eq!(a.create_physical(2 << 20, || Ok(42)), CUDA_SUCCESS);
        a.mapped(0x1000_0000, 2 << 20, 42);
        a.physical_released(42);
        assert_eq!(a.link.held(), 2 << 20, "still mapped");
        a.unmapped(0x1000_0000, 2 << 20);
        assert_eq!(a.link.held(), 0);
    }

    #[test]
    fn a_destroyed_context_credits_what_was_made_in_it() {
        let mut a = accounts(1000);
        // No driver here: both are made in "context 0".
        assert_eq!(a.allocate_device(300, "t", || Ok(1)), CUDA_SUCCESS);
        assert_eq!(a.allocate_array(false, 200, || Ok(2)), CUDA_SUCCESS);
        a.context_gone(7, None, false);
        assert_eq!(a.link.held(), 500, "another context's memory stays charged");
        a.context_gone(0, None, true);
        assert_eq!(a.link.held(), 0, "gone with its context");
        a.freed(1);
        a.array_destroyed(false, 2);
        assert_eq!(a.link.held(), 0, "never credited twice");
        assert_eq!(a.allocate_device(1000, "t", || Ok(3)), CUDA_SUCCESS);
    }

    #[test]
    fn failed_allocation_is_credited_back() {
        let mut a = accounts(100);
        assert_eq!(
            a.allocate_device(60, "t", || Err(CUDA_ERROR_OUT_OF_MEMORY)),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        assert_eq!(a.link.held(), 0);
        assert_eq!(a.allocate_device(60, "t", || Ok(1)), CUDA_SUCCESS);
        assert_eq!(
            a.allocate_device(60, "t", || panic!("not called")),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        a.freed(1);
        assert_eq!(a.allocate_device(60, "t", || Ok(2)), CUDA_SUCCESS);
    }

    #[test]
    fn memory_queries_answer_from_what_was_heard_within_the_bound_else_settle_and_ask() {
        let mut a = accounts_with(1000, 300);
        assert_eq!(a.allocate_device(100, "t", || Ok(1)), CUDA_SUCCESS);
        a.link.heard = Some(a.link.view());
        assert_eq!(a.view().map(|v| v.used), Some(400));
        assert_eq!(a.link.queries, 0, "no round trip while fresh");
        // Stale: pools are settled first (a trim nobody saw is credited), then one query.
        a.pool_created(5, false);
        a.memory.pools.borrow_mut().insert(5, (200, 0));
        a.settle_all_pools();
        assert_eq!(a.link.held(), 300);
        a.memory.pools.borrow_mut().insert(5, (0, 0));
        a.memory.graph.set(Some(50));
        a.link.heard = None;
        let v = a.view().expect("asked");
        assert_eq!(a.link.queries, 1);
        assert_eq!(
            (v.used, v.remaining()),
            (450, 550),
            "the trim credited and the graph pool charged before asking"
        );
    }

    #[test]
    fn a_refusal_over_quota_settles_the_pools_and_tries_once_more() {
        let mut a = accounts(1000);
        a.pool_created(5, false);
        a.memory.pools.borrow_mut().insert(5, (800, 0));
        a.settle_all_pools();
        assert_eq!(a.link.held(), 800);
        // The pool was trimmed inside the driver: the refused charge finds it.
        a.memory.pools.borrow_mut().insert(5, (0, 0));
        assert_eq!(a.allocate_device(700, "t", || Ok(1)), CUDA_SUCCESS);
        assert_eq!(a.link.held(), 700);
    }

    const KEY: ShareKey = ShareKey { dev: 1, ino: 99 };

    #[test]
    fn exported_physical_memory_stays_charged_after_release_and_unmap() {
        let mut a = accounts(1 << 30);
        assert_eq!(a.create_physical(2 << 20, || Ok(42)), CUDA_SUCCESS);
        a.physical_exported(42, Some(KEY));
        a.mapped(0x1000_0000, 2 << 20, 42);
        a.physical_released(42);
        a.unmapped(0x1000_0000, 2 << 20);
        assert_eq!(
            (a.link.held(), a.exported_released()),
            (2 << 20, 2 << 20),
            "an arbiter that cannot take it over: the exporter pays until it exits"
        );
    }

    #[test]
    fn exported_physical_memory_moves_to_the_lease_and_letting_go_is_told() {
        let mut a = accounts(1 << 30);
        a.link.arbiter_shares = true;
        assert_eq!(a.create_physical(2 << 20, || Ok(42)), CUDA_SUCCESS);
        a.physical_exported(42, Some(KEY));
        assert_eq!(a.link.held(), 0, "the lease pays while any holder has it");
        a.mapped(0x1000_0000, 2 << 20, 42);
        a.physical_released(42);
        assert_eq!(a.link.holds, [("share", KEY)], "still mapped here");
        a.unmapped(0x1000_0000, 2 << 20);
        assert_eq!(
            (a.link.holds.clone(), a.exported_released()),
            (vec![("share", KEY), ("unhold", KEY)], 0),
            "released and unmapped: let go, nothing credited here"
        );
    }

    #[test]
    fn imported_physical_memory_is_held_never_charged() {
        let mut a = accounts(1 << 30);
        a.link.arbiter_shares = true;
        a.physical_imported(7, KEY);
        a.mapped(0x2000_0000, 2 << 20, 7);
        a.physical_released(7);
        a.unmapped(0x2000_0000, 2 << 20);
        assert_eq!(a.link.held(), 0);
        assert_eq!(a.link.holds, [("hold", KEY), ("unhold", KEY)]);
    }

    #[test]
    fn graph_memory_pool_is_charged_at_its_reserved_size() {
        let mut a = accounts(1000);
        a.settle_graph_pool(0, Some(400));
        assert_eq!(a.link.held(), 400, "reserved at a graph's launch: charged");
        a.settle_graph_pool(0, Some(400));
        assert_eq!(a.link.held(), 400, "settled: nothing more");
        a.settle_graph_pool(0, Some(100));
        assert_eq!(a.link.held(), 100, "trimmed: credited");
        a.settle_graph_pool(0, Some(1200));
        assert_eq!(
            a.link.held(),
            100,
            "growth beyond the quota stays uncharged here (the arbiter's measurement counts it)"
        );
        a.settle_graph_pool(0, None);
        assert_eq!(a.link.held(), 100, "unreadable: unchanged");
    }

    #[test]
    fn graph_pool_growth_is_reserved_before_the_launch_and_refused_over_quota() {
        let mut a = accounts(1000);
        assert_eq!(a.reserve_graph_pool(0, 400), Ok(()));
        assert_eq!(
            a.link.held(),
            400,
            "the growth is charged before the launch"
        );
        assert_eq!(a.reserve_graph_pool(0, 300), Ok(()));
        assert_eq!(
            a.link.held(),
            400,
            "no growth: nothing charged, nothing credited"
        );
        assert_eq!(
            a.reserve_graph_pool(0, 1200),
            Err(CUDA_ERROR_OUT_OF_MEMORY),
            "growth past the quota is refused"
        );
        assert_eq!(a.link.held(), 400, "and nothing of it charged");
        a.settle_graph_pool(0, Some(400));
        assert_eq!(
            a.link.held(),
            400,
            "the refused launch reserved nothing more"
        );
        assert_eq!(a.reserve_graph_pool(1, 500), Ok(()));
        assert_eq!(a.link.held(), 900, "each device's pool is its own");
    }
}
