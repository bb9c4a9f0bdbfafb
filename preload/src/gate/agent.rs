//! The token agent: one thread per process that connects to the arbiter, publishes
//! the token page, and does what `decide` says — drain and release a revoked, expired
//! or idle token, apply the loss policy and reconnect. It is the only thread that
//! publishes pages after the start, and the only one that waits on the driver for the
//! token: on blocking-sync events, asleep, however long the process's kernels run.

use std::path::Path;
use std::sync::atomic::Ordering::{Acquire, Relaxed};
use std::sync::Arc;
use std::time::Duration;

use gpushare_proto::token::FLAG_CUT_OFF;
use gpushare_proto::token_client::{TokenClientError, TokenConnection};
use gpushare_proto::{LossPolicy, Priority, TokenPage};

use super::decide::{self, Action, Memory, Observation, Snapshot};
use super::{monotonic_ns, Client, Gate, Link, UNGATED, WAITING};

/// Bound on each read and write of the opening.
const OPEN_TIMEOUT: Duration = Duration::from_secs(2);
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// The terms the agent acts on, from the last `Scheduled`.
#[derive(Debug, Clone, Copy)]
struct Terms {
    idle_ns: u64,
    on_loss: LossPolicy,
}

/// How an opening ended.
enum Opened {
    Connected(Arc<Link>, Terms),
    /// The arbiter answered and will not schedule this client.
    Refused(String),
    Unreachable(TokenClientError),
}

pub(super) fn run(gate: &'static Gate, client: &'static Client, socket: std::path::PathBuf) {
    // Every wait this thread makes is for the token, never part of a capture: in the
    // default GLOBAL mode each of them would fail and invalidate a capture another
    // thread has begun in GLOBAL mode (PyTorch's default), so this thread is RELAXED
    // for life. A driver without modes (before CUDA 10.1) has no such rule.
    let _ = crate::driver::exchange_capture_mode(crate::driver::CU_STREAM_CAPTURE_MODE_RELAXED);
    // A process that never reached the arbiter cannot know its class: it waits.
    let mut terms: Option<Terms> = None;
    let mut cut_off = false;
    let mut backoff = FIRST_BACKOFF;
    // The launch counter when the last connection was lost (0: never connected).
    let mut launches_when_lost = 0;
    loop {
        let (link, current) = match open(gate, client, &socket, launches_when_lost) {
            Opened::Connected(link, current) => (link, current),
            Opened::Refused(reason) if !cut_off => {
                crate::log_info!(
                    "the arbiter does not schedule this process ({reason}): launches run ungated"
                );
                gate.publish(&UNGATED);
                return;
            }
            Opened::Refused(reason) => {
                // Cut off (its lease ended): it may not run, and asking again later
                // costs little (a lease that ended stays refused).
                crate::log_debug!("still refused after a cut-off: {reason}");
                gate.publish(&WAITING);
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
            Opened::Unreachable(e) => {
                crate::log_debug!("token connection at {}: {e}", socket.display());
                if terms.is_none() {
                    // Never connected: the class the ledger learned decides (a
                    // high-priority process runs, as its loss policy would have it).
                    gate.publish(if gate.known_high() {
                        &UNGATED
                    } else {
                        &WAITING
                    });
                }
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        backoff = FIRST_BACKOFF;
        terms = Some(current);
        crate::log_info!(
            "token connection open (idle after {} µs)",
            current.idle_ns / 1000
        );
        let Some(was_cut_off) = serve(gate, client, &link, current) else {
            // A fork child's copy of this process abandoned the client: its socket is
            // closed already (the number may be reused), so nothing may be dropped.
            std::mem::forget(link);
            return;
        };
        cut_off = was_cut_off;
        // Lost: the loss policy holds until the next connection is served.
        let policy = terms.map_or(LossPolicy::Wait, |t| t.on_loss);
        gate.publish(match policy {
            LossPolicy::Run => &UNGATED,
            LossPolicy::Wait => &WAITING,
        });
        client.set_link(None);
        drop(link);
        client.want_sent.store(false, Relaxed);
        launches_when_lost = gate.launches();
        crate::log_info!(
            "token connection lost{}: launches {} until it is back",
            if cut_off { " (cut off)" } else { "" },
            if policy == LossPolicy::Run {
                "run ungated"
            } else {
                "wait"
            }
        );
    }
}

/// `launches_before`: the launch counter when the previous connection was lost (0 at
/// the first).
fn open(
    gate: &'static Gate,
    client: &'static Client,
    socket: &Path,
    launches_before: u64,
) -> Opened {
    let connection = match TokenConnection::open(socket, OPEN_TIMEOUT) {
        Ok(c) => c,
        Err(TokenClientError::Refused { kind, message }) => {
            return Opened::Refused(format!("{kind:?}: {message}"))
        }
        Err(TokenClientError::Version(v)) => {
            return Opened::Refused(format!("protocol version {v}"))
        }
        Err(e) => return Opened::Unreachable(e),
    };
    let terms = connection.terms();
    let current = Terms {
        idle_ns: terms.idle_ns,
        on_loss: terms.on_arbiter_loss,
    };
    let high = terms.priority == Priority::High;
    client.high.store(high, Relaxed);
    client.connected(terms.fit_launches);
    let link = Arc::new(Link::new(connection, gate));
    client.set_link(Some(link.clone()));
    client.want_sent.store(false, Relaxed);
    gate.publish(link.page());
    // A high-priority process known as such (from its ledger) launched without a
    // connection, ungated: it announces itself now, as its launch would have on a
    // connected page, or a low-priority holder keeps the GPU until its next launch.
    // (The ledger attaches at context creation, so this is the common case for a
    // high-priority process's first launch.)
    let launched_unannounced = high && gate.launches() != launches_before;
    if client.waiters.load(Acquire) > 0 || launched_unannounced {
        client.want();
    }
    Opened::Connected(link, current)
}

/// Serves one connection until it is lost; returns whether it was cut off, or `None`
/// when the client was abandoned (only a gate reset in a test does that to a live
/// agent: after a real fork the agent thread does not exist in the child).
fn serve(gate: &Gate, client: &'static Client, link: &Link, terms: Terms) -> Option<bool> {
    let page: &TokenPage = link.page();
    // Every connection has a page of its own whose grant count starts at 0, so a grant
    // already there was made since `open` (which may have sent `Want`) and is owed an
    // answer. Taking the current count as answered left such a grant unreleased until
    // the arbiter gave up on it after its grace (then a cut-off, now an overdue report;
    // seen in 2 of 24 runs of the kill test, with four low clients joining together).
    let mut memory = Memory::fresh(0, gate.launches(), monotonic_ns());
    loop {
        if !std::ptr::eq(gate.client.load(Acquire), client) {
            return None;
        }
        let seq = page.seq.load(Acquire);
        let seen = Observation {
            page: Snapshot {
                deadline_ns: page.deadline_ns.load(Acquire),
                grants: page.grants.load(Acquire),
                flags: page.flags.load(Acquire),
            },
            closed: link.connection.is_closed(),
            now_ns: monotonic_ns(),
            launches: gate.launches(),
            busy: client.work.captures_under_way() > 0 || client.ring_waiters.load(Acquire) > 0,
        };
        match decide::decide(&seen, &mut memory, terms.idle_ns) {
            Action::Lost { cut_off } => return Some(cut_off),
            Action::Sleep { timeout_ns } => {
                link.connection
                    .wait_for_change(seq, Duration::from_nanos(timeout_ns.max(1)));
            }
            Action::Release(reason) => {
                let before = gate.launches();
                drain(gate, client);
                let sent = client.release(link, |waiters| {
                    decide::release_after_drain(reason, before, gate.launches(), waiters)
                });
                match sent {
                    Ok(Some(_)) => memory.answered_grants = seen.page.grants,
                    // Launched while draining: still busy, the idle clock restarts.
                    Ok(None) => {}
                    Err(e) => {
                        crate::log_debug!("release: {e}");
                        return Some(page.flags.load(Acquire) & FLAG_CUT_OFF != 0);
                    }
                }
            }
        }
    }
}

/// Waits for the process's submitted work to complete, in every context, without
/// touching a stream capture (see `work`) — launches the gate let through before the
/// page changed included: they reach the driver first (see `Submitting`).
fn drain(gate: &Gate, client: &Client) {
    gate.await_submissions();
    let drained = client.work.drain(&super::work::Driver);
    crate::log_debug!(
        "drained: {} streams waited for, {} left alone (capturing, or beside a capture)",
        drained.streams,
        drained.skipped
    );
}
