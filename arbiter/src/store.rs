//! Durable lease records: an append-only log with group commit, compacted into
//! a snapshot.
//!
//! Why not rewrite one JSON file per change (the first version): that costs two
//! fsyncs and a rewrite of every lease per change, ~4 ms here, so one container
//! start waited behind every other. Appending one line per change and letting a
//! single writer thread fsync whatever has accumulated since its last fsync (group
//! commit) makes a change cost one `fdatasync` shared by every change made
//! meanwhile: `cargo bench -p gpushare-arbiter` measures both.
//!
//! Durability: a change is acknowledged only after the fsync that covers it
//! (`wait`). Records are whole-state (`put` a lease, `delete` an id), so replaying
//! any prefix of the log over the snapshot it follows — or over a newer snapshot,
//! if a crash struck between writing a snapshot and truncating the log — yields
//! the state after that prefix. A torn last line (crash mid-append) is dropped; a
//! bad line followed by good ones is corruption and refuses to load, and so does a
//! whole line that parses but holds a value no arbiter writes (a lease id that is
//! not a plain name: ids become paths under `run_dir`).
//!
//! Write failures (a full `state_dir`, an I/O error): the batch that failed, and
//! everything appended before the failure was seen, is refused — its tickets
//! fail, for good — and later appends are refused at once. Nothing more is
//! written to the log, whose tail may now be a partial line. The owner of the
//! in-memory table (the arbiter) then calls `recover` with that table, once it
//! has taken out the changes that were never acknowledged (reserves whose ticket
//! failed): `recover` writes it as a snapshot and empties the log, and the store
//! accepts changes again. Every acknowledged change is in that table (memory is
//! changed before the record is appended, and acknowledged only after), so no
//! acknowledged lease is lost; a change that was refused may or may not survive
//! (a refused release may still have happened), exactly as after a crash.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use gpushare_proto::grant::{BadGrantId, Grant, GrantId};
use gpushare_proto::lease::BadLeaseId;
use gpushare_proto::{Lease, LeaseId};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

const SNAPSHOT: &str = "leases.json";
const LOG: &str = "leases.log";

/// A lease plus what the arbiter learnt about its container at confirmation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaseRecord {
    #[serde(flatten)]
    pub lease: Lease,
    /// The container's cgroup (host view), for peer checks.
    #[serde(default)]
    pub cgroup: Option<String>,
    /// Start time of the confirmed pid (clock ticks since boot), so a reused pid
    /// is not mistaken for the container.
    #[serde(default)]
    pub pid_start_time: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Record {
    Put {
        lease: Box<LeaseRecord>,
    },
    Delete {
        id: LeaseId,
    },
    Drain {
        gpu: String,
        drained: bool,
    },
    /// A grant made or moved. Stored without its binding (`Grant::lease`, and the
    /// GPU of a high or compute grant): that is derived at load from the leases'
    /// `pod.grants`, so it cannot disagree with them.
    PutGrant {
        grant: Box<Grant>,
    },
    DeleteGrant {
        id: GrantId,
    },
}

/// Everything the store holds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Table {
    pub leases: BTreeMap<LeaseId, LeaseRecord>,
    pub drained: BTreeSet<String>,
    pub grants: BTreeMap<GrantId, Grant>,
}

/// Why a record's id is refused where it is read back.
#[derive(Debug, thiserror::Error)]
enum BadRecordId {
    #[error(transparent)]
    Lease(#[from] BadLeaseId),
    #[error(transparent)]
    Grant(#[from] BadGrantId),
}

impl Record {
    /// Ids become directory names under `run_dir`: one that is not a plain name
    /// (`../../x`) is refused where it is read back, never used.
    fn check_ids(&self) -> Result<(), BadRecordId> {
        match self {
            Record::Put { lease } => LeaseId::parse(lease.lease.id.0.as_str()).map(drop)?,
            Record::Delete { id } => LeaseId::parse(id.0.as_str()).map(drop)?,
            Record::Drain { .. } => {}
            // Grant ids appear in annotations, logs and metric labels.
            Record::PutGrant { grant } => GrantId::parse(grant.id.0.as_str()).map(drop)?,
            Record::DeleteGrant { id } => GrantId::parse(id.0.as_str()).map(drop)?,
        }
        Ok(())
    }
}

impl Table {
    pub fn apply(&mut self, record: &Record) {
        match record {
            Record::Put { lease } => {
                self.leases
                    .insert(lease.lease.id.clone(), (**lease).clone());
            }
            Record::Delete { id } => {
                self.leases.remove(id);
            }
            Record::Drain { gpu, drained } => {
                if *drained {
                    self.drained.insert(gpu.clone());
                } else {
                    self.drained.remove(gpu);
                }
            }
            Record::PutGrant { grant } => {
                self.grants.insert(grant.id.clone(), (**grant).clone());
            }
            Record::DeleteGrant { id } => {
                self.grants.remove(id);
            }
        }
    }

    /// How many entries compaction would write.
    fn len(&self) -> usize {
        self.leases.len() + self.grants.len()
    }
}

#[derive(Serialize, Deserialize)]
struct Snapshot {
    version: u32,
    leases: Vec<LeaseRecord>,
    drained: Vec<String>,
    /// Absent from the snapshots of arbiters without grants.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    grants: Vec<Grant>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum SnapshotFile {
    Current(Snapshot),
    /// The first arbiter's format: a bare array of leases.
    Legacy(Vec<LeaseRecord>),
}

#[derive(Debug, thiserror::Error, Clone)]
pub enum StoreError {
    #[error("lease store {path}: {message}")]
    Io { path: PathBuf, message: String },
    #[error("lease store {path} is corrupt at line {line}: {message}")]
    Corrupt {
        path: PathBuf,
        line: usize,
        message: String,
    },
    /// Writes are failing (or this change was in a batch that failed). Not a
    /// restart hint: the arbiter recovers by itself once the store can be written.
    #[error("the lease store cannot be written ({0}); the change was refused (changes are accepted again once the store can be written)")]
    Failed(Arc<str>),
    #[error("the lease store's writer has stopped")]
    Stopped,
    #[error("lease store {path} is corrupt: {source}")]
    BadSnapshotLease { path: PathBuf, source: BadLeaseId },
    #[error("lease store {path} is corrupt: {source}")]
    BadSnapshotGrant { path: PathBuf, source: BadGrantId },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |e| StoreError::Io {
        path: path.to_owned(),
        message: e.to_string(),
    }
}

#[derive(Debug, Clone, Default)]
struct Durable {
    /// Every ticket up to here is durable, except those in `lost`.
    seq: u64,
    /// Why writes are failing now: tickets beyond `seq` fail until `recover`.
    failed: Option<Arc<str>>,
    /// Tickets a recovery superseded (inclusive ranges, with why they failed).
    /// They stay failed for good: a reserve among them was taken back, so a
    /// waiter that looks only after the recovery must still hear "failed", never
    /// "durable".
    lost: Vec<(u64, u64, Arc<str>)>,
}

/// Far more failure-and-recovery cycles than one waiter can span (a waiter looks
/// within milliseconds of its append); keeps the list from growing forever on a
/// disk that fills and empties all day.
const MAX_LOST_RANGES: usize = 1024;

impl Durable {
    /// None while the ticket is still in flight.
    fn outcome(&self, ticket: u64) -> Option<Result<(), StoreError>> {
        if let Some((_, _, why)) = self
            .lost
            .iter()
            .find(|(from, to, _)| (*from..=*to).contains(&ticket))
        {
            return Some(Err(StoreError::Failed(why.clone())));
        }
        if ticket <= self.seq {
            return Some(Ok(()));
        }
        self.failed
            .as_ref()
            .map(|why| Err(StoreError::Failed(why.clone())))
    }
}

#[derive(Default)]
struct Pending {
    lines: Vec<u8>,
    records: Vec<Record>,
    appended: u64,
    shutdown: bool,
    /// Bumped by `recover`: lines the writer took before it belong to the failed
    /// log and must not be written after the snapshot that superseded them.
    epoch: u64,
}

struct Shared {
    pending: Mutex<Pending>,
    work: Condvar,
    durable: Mutex<Durable>,
    durable_changed: Condvar,
    durable_watch: watch::Sender<Durable>,
    /// The files: held by the writer while it commits and by `recover`.
    io: Mutex<Io>,
}

impl Shared {
    fn publish(&self, durable: std::sync::MutexGuard<'_, Durable>) {
        let snapshot = durable.clone();
        drop(durable);
        self.durable_changed.notify_all();
        self.durable_watch.send_replace(snapshot);
    }
}

/// A change's place in the log: wait for it before acknowledging the change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[must_use = "a change is durable only once its ticket has been waited for"]
pub struct Ticket(u64);

pub struct StoreOptions {
    /// Compact once the log holds this many records beyond twice the live leases.
    pub compact_after: usize,
}

impl Default for StoreOptions {
    fn default() -> Self {
        // Replaying a few thousand lines costs milliseconds; compacting more often
        // would rewrite every lease for little gain.
        StoreOptions {
            compact_after: 4096,
        }
    }
}

pub struct LeaseStore {
    shared: Arc<Shared>,
    writer: Option<JoinHandle<()>>,
}

impl LeaseStore {
    /// Loads the durable table and starts the writer.
    pub fn open(dir: &Path, options: StoreOptions) -> Result<(Self, Table), StoreError> {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let snapshot_path = dir.join(SNAPSHOT);
        let log_path = dir.join(LOG);
        for path in [&snapshot_path, &log_path] {
            owner_only(path)?;
        }
        let mut table = load_snapshot(&snapshot_path)?;
        let (records, valid_len) = read_log(&log_path)?;
        for r in &records {
            table.apply(r);
        }
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(OWNER_ONLY)
            .open(&log_path)
            .map_err(io_err(&log_path))?;
        // Drop a torn tail now, so new records do not follow garbage.
        if log.metadata().map_err(io_err(&log_path))?.len() != valid_len {
            log.set_len(valid_len).map_err(io_err(&log_path))?;
            log.sync_all().map_err(io_err(&log_path))?;
        }
        let (durable_watch, _) = watch::channel(Durable::default());
        let shared = Arc::new(Shared {
            pending: Mutex::new(Pending::default()),
            work: Condvar::new(),
            durable: Mutex::new(Durable::default()),
            durable_changed: Condvar::new(),
            durable_watch,
            io: Mutex::new(Io {
                dir: dir.to_owned(),
                log,
                log_records: records.len(),
                table: table.clone(),
                compact_after: options.compact_after,
                #[cfg(test)]
                fail_writes: false,
            }),
        });
        let writer = Writer {
            shared: shared.clone(),
        };
        let handle = std::thread::Builder::new()
            .name("lease-store".into())
            .spawn(move || writer.run())
            .map_err(io_err(dir))?;
        Ok((
            LeaseStore {
                shared,
                writer: Some(handle),
            },
            table,
        ))
    }

    /// Queues a record; the caller must `wait` for the ticket before acknowledging.
    /// Records are written in the order they are appended. Refused at once while
    /// writes are failing.
    pub fn append(&self, record: Record) -> Result<Ticket, StoreError> {
        if let Some(failed) = lock(&self.shared.durable).failed.clone() {
            return Err(StoreError::Failed(failed));
        }
        let mut line = serde_json::to_vec(&record).expect("records always serialise");
        line.push(b'\n');
        let mut pending = lock(&self.shared.pending);
        pending.lines.extend_from_slice(&line);
        pending.records.push(record);
        pending.appended += 1;
        let ticket = Ticket(pending.appended);
        drop(pending);
        self.shared.work.notify_one();
        Ok(ticket)
    }

    pub fn wait_blocking(&self, ticket: Ticket) -> Result<(), StoreError> {
        let mut durable = lock(&self.shared.durable);
        loop {
            if let Some(outcome) = durable.outcome(ticket.0) {
                return outcome;
            }
            durable = self
                .shared
                .durable_changed
                .wait(durable)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    pub async fn wait(&self, ticket: Ticket) -> Result<(), StoreError> {
        let mut rx = self.shared.durable_watch.subscribe();
        let durable = rx
            .wait_for(|d| d.outcome(ticket.0).is_some())
            .await
            .map_err(|_| StoreError::Stopped)?;
        durable.outcome(ticket.0).expect("waited for an outcome")
    }

    /// Whether the ticket's record is durable now (false while in flight or failed).
    pub fn is_durable(&self, ticket: Ticket) -> bool {
        matches!(lock(&self.shared.durable).outcome(ticket.0), Some(Ok(())))
    }

    /// Whether the ticket's record will never be durable (its batch failed, or a
    /// recovery superseded it).
    pub fn has_failed(&self, ticket: Ticket) -> bool {
        matches!(lock(&self.shared.durable).outcome(ticket.0), Some(Err(_)))
    }

    /// Why writes are failing, while they are (None: the store accepts changes).
    pub fn failure(&self) -> Option<Arc<str>> {
        lock(&self.shared.durable).failed.clone()
    }

    /// After a write failure: makes `table` the durable state (snapshot, then an
    /// empty log) and accepts changes again. Every ticket not durable before the
    /// failure fails for good. A no-op while writes are not failing.
    ///
    /// The caller must hold off every `append` meanwhile (the arbiter calls it with
    /// its lock held, and appends only under that lock) and must have taken out of
    /// `table` what it never acknowledged and does not want to keep. If it fails
    /// (still no space), the store stays failed and it may be called again.
    ///
    /// A crash between the snapshot's rename and the log's truncation replays the
    /// old log over the new snapshot: whole records of the failed batch may then
    /// come back (a refused reserve returns as an unconfirmed lease, reconciled
    /// after `reserved_timeout_ms`; a refused release is undone), never an
    /// acknowledged change lost: the log's durable part is older than the
    /// snapshot, which holds everything acknowledged.
    pub fn recover(&self, table: &Table) -> Result<(), StoreError> {
        let mut io = lock(&self.shared.io);
        let Some(why) = self.failure() else {
            return Ok(());
        };
        let upto = {
            let mut pending = lock(&self.shared.pending);
            pending.lines.clear();
            pending.records.clear();
            pending.epoch += 1;
            pending.appended
        };
        io.replace(table)?;
        let mut durable = lock(&self.shared.durable);
        if upto > durable.seq {
            let from = durable.seq + 1;
            durable.lost.push((from, upto, why));
            if durable.lost.len() > MAX_LOST_RANGES {
                durable.lost.remove(0);
            }
            durable.seq = upto;
        }
        durable.failed = None;
        tracing::info!(
            leases = table.leases.len(),
            "lease store writable again: wrote the in-memory table as a snapshot and emptied the log"
        );
        self.shared.publish(durable);
        Ok(())
    }
}

impl LeaseStore {
    /// Folds the log into the snapshot, so the next open reads one file (a clean
    /// stop). Records still on their way are not lost: the writer appends them to
    /// the emptied log, whose replay over the snapshot is harmless.
    pub fn compact(&self) -> Result<(), StoreError> {
        let mut io = lock(&self.shared.io);
        if let Some(failed) = lock(&self.shared.durable).failed.clone() {
            return Err(StoreError::Failed(failed));
        }
        io.compact()
    }
}

#[cfg(test)]
impl LeaseStore {
    /// Makes every write fail (ENOSPC) until called with false.
    pub(crate) fn fail_writes(&self, fail: bool) {
        lock(&self.shared.io).fail_writes = fail;
    }
}

impl Drop for LeaseStore {
    /// Flushes what is queued, then stops the writer.
    fn drop(&mut self) {
        lock(&self.shared.pending).shutdown = true;
        self.shared.work.notify_one();
        if let Some(handle) = self.writer.take() {
            let _ = handle.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every critical section here leaves its data consistent, so a panic
    // elsewhere while holding the lock does not make it unusable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The log and snapshot files, and the durable table compaction writes.
struct Io {
    dir: PathBuf,
    log: File,
    log_records: usize,
    table: Table,
    compact_after: usize,
    /// Unit tests make writes fail as a full disk would.
    #[cfg(test)]
    fail_writes: bool,
}

struct Writer {
    shared: Arc<Shared>,
}

impl Writer {
    fn run(self) {
        loop {
            let (lines, records, upto, shutdown, epoch) = {
                let mut pending = lock(&self.shared.pending);
                while pending.lines.is_empty() && !pending.shutdown {
                    pending = self
                        .shared
                        .work
                        .wait(pending)
                        .unwrap_or_else(|p| p.into_inner());
                }
                (
                    std::mem::take(&mut pending.lines),
                    std::mem::take(&mut pending.records),
                    pending.appended,
                    pending.shutdown,
                    pending.epoch,
                )
            };
            if !lines.is_empty() {
                let mut io = lock(&self.shared.io);
                // Taken before a recovery: superseded by its snapshot.
                let superseded = lock(&self.shared.pending).epoch != epoch;
                // After a failure the log may end in a partial line: nothing may
                // follow it until a recovery has replaced the log. These tickets
                // fail with the batch that failed.
                let failed = lock(&self.shared.durable).failed.is_some();
                if !superseded && !failed {
                    let result = io.commit(&lines, &records);
                    drop(io);
                    let mut durable = lock(&self.shared.durable);
                    match result {
                        Ok(()) => durable.seq = upto,
                        Err(e) => {
                            tracing::error!(error = %e, "lease store write failed; refusing changes until it can be written again");
                            durable.failed = Some(e.to_string().into());
                        }
                    }
                    self.shared.publish(durable);
                }
            }
            if shutdown && lock(&self.shared.pending).lines.is_empty() {
                return;
            }
        }
    }
}

impl Io {
    #[cfg(test)]
    fn injected_failure(&self) -> Result<(), StoreError> {
        match self.fail_writes {
            true => Err(io_err(&self.dir)(std::io::Error::from_raw_os_error(
                28, // ENOSPC
            ))),
            false => Ok(()),
        }
    }

    fn commit(&mut self, lines: &[u8], records: &[Record]) -> Result<(), StoreError> {
        let path = self.dir.join(LOG);
        #[cfg(test)]
        self.injected_failure()?;
        self.log.write_all(lines).map_err(io_err(&path))?;
        self.log.sync_data().map_err(io_err(&path))?;
        for r in records {
            self.table.apply(r);
        }
        self.log_records += records.len();
        if self.log_records > self.compact_after + 2 * self.table.len() {
            // The records are durable in the log already: a compaction that fails
            // (no room for the snapshot) must not fail them. The next commit tries
            // again; the log keeps growing meanwhile, which is still correct.
            if let Err(e) = self.compact() {
                tracing::warn!(error = %e, "lease log compaction failed; will retry");
            }
        }
        Ok(())
    }

    fn compact(&mut self) -> Result<(), StoreError> {
        let table = self.table.clone();
        self.replace(&table)
    }

    /// Makes `table` the whole durable state: snapshot first, then an empty log.
    fn replace(&mut self, table: &Table) -> Result<(), StoreError> {
        #[cfg(test)]
        self.injected_failure()?;
        write_snapshot(&self.dir, table)?;
        let path = self.dir.join(LOG);
        self.log.set_len(0).map_err(io_err(&path))?;
        self.log.sync_all().map_err(io_err(&path))?;
        self.log_records = 0;
        self.table = table.clone();
        Ok(())
    }
}

/// The store's files name every container, its pod and its grants: root's alone,
/// whatever the daemon's umask.
pub(crate) const OWNER_ONLY: u32 = 0o600;

/// Closes a state file an older version (or a umask) left readable to others.
pub(crate) fn owner_only(path: &Path) -> Result<(), StoreError> {
    match fs::metadata(path) {
        Ok(meta) if meta.permissions().mode() & 0o077 != 0 => {
            fs::set_permissions(path, fs::Permissions::from_mode(OWNER_ONLY))
                .map_err(io_err(path))?;
            tracing::info!(path = %path.display(), "closed a state file other users could open (now 0600)");
            Ok(())
        }
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(path)(e)),
    }
}

/// Atomic replace: temporary file, fsync, rename, fsync the directory.
fn write_snapshot(dir: &Path, table: &Table) -> Result<(), StoreError> {
    let path = dir.join(SNAPSHOT);
    let tmp = dir.join(format!("{SNAPSHOT}.tmp"));
    let snapshot = Snapshot {
        version: 1,
        leases: table.leases.values().cloned().collect(),
        drained: table.drained.iter().cloned().collect(),
        grants: table.grants.values().cloned().collect(),
    };
    let body = serde_json::to_vec(&snapshot).expect("snapshots always serialise");
    // A leftover from a crash keeps the mode it was made with: start afresh.
    let _ = fs::remove_file(&tmp);
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(OWNER_ONLY)
        .open(&tmp)
        .and_then(|mut file| {
            file.write_all(&body)?;
            file.sync_all()
        })
        .map_err(io_err(&tmp));
    if let Err(e) = written {
        // A partial file on a full disk holds the very space a retry needs.
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    fs::rename(&tmp, &path).map_err(io_err(&path))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))?;
    Ok(())
}

fn load_snapshot(path: &Path) -> Result<Table, StoreError> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Table::default()),
        Err(e) => return Err(io_err(path)(e)),
    };
    let file: SnapshotFile = serde_json::from_slice(&bytes).map_err(|e| StoreError::Corrupt {
        path: path.to_owned(),
        line: e.line(),
        message: e.to_string(),
    })?;
    let (leases, drained, grants) = match file {
        SnapshotFile::Current(s) => (s.leases, s.drained, s.grants),
        SnapshotFile::Legacy(leases) => (leases, Vec::new(), Vec::new()),
    };
    for g in &grants {
        GrantId::parse(g.id.0.as_str()).map_err(|source| StoreError::BadSnapshotGrant {
            path: path.to_owned(),
            source,
        })?;
    }
    for l in &leases {
        LeaseId::parse(l.lease.id.0.as_str()).map_err(|source| StoreError::BadSnapshotLease {
            path: path.to_owned(),
            source,
        })?;
    }
    Ok(Table {
        leases: leases
            .into_iter()
            .map(|l| (l.lease.id.clone(), l))
            .collect(),
        drained: drained.into_iter().collect(),
        grants: grants.into_iter().map(|g| (g.id.clone(), g)).collect(),
    })
}

/// The records of the log and the length of its valid prefix.
fn read_log(path: &Path) -> Result<(Vec<Record>, u64), StoreError> {
    let mut bytes = Vec::new();
    match File::open(path) {
        Ok(mut f) => {
            f.read_to_end(&mut bytes).map_err(io_err(path))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(io_err(path)(e)),
    }
    parse_log(&bytes).map_err(|(line, message)| StoreError::Corrupt {
        path: path.to_owned(),
        line,
        message,
    })
}

/// Pure: whole lines that parse, up to a torn tail. Err((line, why)) when a bad
/// line is followed by a good one, or when a whole line holds a refused value.
pub fn parse_log(bytes: &[u8]) -> Result<(Vec<Record>, u64), (usize, String)> {
    let mut records = Vec::new();
    let mut valid_len = 0u64;
    let mut offset = 0usize;
    let mut bad: Option<(usize, String)> = None;
    for (n, chunk) in bytes.split_inclusive(|&b| b == b'\n').enumerate() {
        offset += chunk.len();
        let parsed = match chunk.strip_suffix(b"\n") {
            Some(line) => match serde_json::from_slice::<Record>(line) {
                Ok(r) => match r.check_ids() {
                    Ok(()) => Ok(r),
                    // Written whole that way, not torn: refused wherever it is.
                    Err(e) => return Err((n + 1, e.to_string())),
                },
                // A whole line that is well-formed JSON but holds a value no arbiter
                // writes (a lease id that is not a plain name, an unknown op) was
                // written that way, not torn by a crash: never drop it silently,
                // wherever it is.
                Err(e) if e.classify() == serde_json::error::Category::Data => {
                    return Err((n + 1, e.to_string()))
                }
                Err(e) => Err(e.to_string()),
            },
            None => Err("incomplete last line".to_owned()),
        };
        match (parsed, &bad) {
            (Ok(r), None) => {
                records.push(r);
                valid_len = offset as u64;
            }
            (Ok(_), Some((line, why))) => return Err((*line, why.clone())),
            (Err(why), None) => bad = Some((n + 1, why)),
            (Err(_), Some(_)) => {}
        }
    }
    if let Some((line, why)) = &bad {
        tracing::warn!(line, reason = %why, "dropping a torn tail of the lease log");
    }
    Ok((records, valid_len))
}

#[cfg(test)]
mod tests;
