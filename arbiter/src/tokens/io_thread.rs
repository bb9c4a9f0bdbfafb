//! The GPU's I/O thread: every token connection of one GPU served from one epoll
//! loop (mio), frames read and answered without the async runtime.

use super::*;

/// What the I/O thread keeps across a restart: its epoll set and connections, and
/// which connection it was serving (the one a panic is blamed on).
pub(super) struct IoLoop {
    pub(super) poll: mio::Poll,
    pub(super) connections: HashMap<ClientId, Connection>,
    pub(super) serving: Option<ClientId>,
}

/// How long after a token thread's failure the arbiter reports itself unhealthy.
pub const THREAD_FAILURE_SHOWN_NS: u64 = 60 * 1_000_000_000;

/// A GPU's token thread failures: counted, and the latest one's time.
#[derive(Default)]
pub(super) struct ThreadRestarts {
    pub(super) count: AtomicU64,
    /// CLOCK_MONOTONIC of the latest failure; 0: none yet.
    pub(super) latest_ns: AtomicU64,
}

impl ThreadRestarts {
    pub(super) fn failed(&self, gpu: &str, thread: &str) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.latest_ns
            .store(monotonic_ns().max(1), Ordering::Relaxed);
        tracing::error!(gpu = %gpu, thread, "a token thread failed (panicked) and was restarted; its clients go on being scheduled, the connection it was serving was dropped");
    }

    /// Whether a failure happened within [`THREAD_FAILURE_SHOWN_NS`] of `now`.
    pub(super) fn recent(&self, now: u64) -> bool {
        let latest = self.latest_ns.load(Ordering::Relaxed);
        latest != 0 && now.saturating_sub(latest) < THREAD_FAILURE_SHOWN_NS
    }
}

/// The waker's token; clients' tokens are their ids, which start at 1.
pub(super) const WAKE: mio::Token = mio::Token(0);

/// A connection on its way to the GPU's I/O thread.
pub(super) struct Arriving {
    pub(super) client: ClientId,
    pub(super) connection: Connection,
}

/// The GPU's side of its I/O thread: new connections are queued here and the thread
/// is woken to register them.
pub(super) struct IoHandoff {
    pub(super) arriving: Mutex<Vec<Arriving>>,
    pub(super) waker: mio::Waker,
}

impl IoHandoff {
    pub(super) fn new() -> io::Result<(IoHandoff, mio::Poll)> {
        let poll = mio::Poll::new()?;
        let waker = mio::Waker::new(poll.registry(), WAKE)?;
        let handoff = IoHandoff {
            arriving: Mutex::new(Vec::new()),
            waker,
        };
        Ok((handoff, poll))
    }

    pub(super) fn hand_over(&self, arriving: Arriving) {
        self.arriving
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(arriving);
        if let Err(e) = self.waker.wake() {
            tracing::error!(error = %e, "cannot wake the token I/O thread");
        }
    }

    pub(super) fn take(&self) -> Vec<Arriving> {
        std::mem::take(&mut *self.arriving.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// One token connection as its I/O thread holds it: the socket, the bytes of a frame
/// not yet complete, and its place in the connection budget.
pub(super) struct Connection {
    pub(super) stream: Arc<UnixStream>,
    pub(super) buffer: [u8; MAX_TOKEN_FRAME],
    pub(super) filled: usize,
    pub(super) _permit: Permit,
}

impl Connection {
    pub(super) fn new(stream: Arc<UnixStream>, permit: Permit) -> Connection {
        Connection {
            stream,
            buffer: [0; MAX_TOKEN_FRAME],
            filled: 0,
            _permit: permit,
        }
    }

    pub(super) fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Reads what the socket has (edge-triggered: until it would block) and passes
    /// every complete request to `handle`. Err ends the connection (EOF included).
    pub(super) fn pump(&mut self, mut handle: impl FnMut(TokenRequest)) -> Result<(), TokenError> {
        loop {
            let read = (&*self.stream).read(&mut self.buffer[self.filled..]);
            match read {
                Ok(0) => return Err(FrameError::Closed.into()),
                Ok(n) => self.filled += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.into()),
            }
            while let Some(request) = self.next_request()? {
                handle(request);
            }
        }
    }

    /// The first complete frame in the buffer, removed from it.
    pub(super) fn next_request(&mut self) -> Result<Option<TokenRequest>, TokenError> {
        let Some(length) = frame_length(&self.buffer[..self.filled])? else {
            return Ok(None);
        };
        let end = 4 + length;
        if self.filled < end {
            return Ok(None);
        }
        let request = serde_json::from_slice(&self.buffer[4..end]).map_err(TokenError::Malformed);
        self.buffer.copy_within(end..self.filled, 0);
        self.filled -= end;
        request.map(Some)
    }
}

/// The body length a frame header announces, once all four bytes are there; a frame
/// longer than [`MAX_TOKEN_FRAME`] is refused before any of its body is read.
pub(super) fn frame_length(bytes: &[u8]) -> Result<Option<usize>, TokenError> {
    let Some(header) = bytes.first_chunk::<4>() else {
        return Ok(None);
    };
    let length = u32::from_be_bytes(*header) as usize;
    if length > MAX_TOKEN_FRAME - 4 {
        return Err(TokenError::Oversized(length.saturating_add(4)));
    }
    Ok(Some(length))
}

impl GpuToken {
    /// The GPU's I/O thread: every token connection of the GPU, on one epoll set. A
    /// panic while serving one connection drops that connection (its token is lost, as
    /// at its death) and the loop starts again with every other connection still
    /// registered, so their clients go on being granted.
    pub(super) fn run_io(&self, poll: mio::Poll) {
        let mut io = IoLoop {
            poll,
            connections: HashMap::new(),
            serving: None,
        };
        let mut restarted = false;
        while std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if restarted {
                self.recover_io(&mut io);
            }
            self.serve_io(&mut io)
        }))
        .is_err()
        {
            self.restarts.failed(&self.gpu, "token-io");
            restarted = true;
        }
    }

    /// After a failure: the connection being served is dropped, and whatever the
    /// failed step left undone (a grant, a wake) is decided again.
    pub(super) fn recover_io(&self, io: &mut IoLoop) {
        if let Some(client) = io.serving.take() {
            if let Some(connection) = io.connections.remove(&client) {
                let fd = connection.fd();
                let _ = io.poll.registry().deregister(&mut mio::unix::SourceFd(&fd));
            }
            self.leave(client, None);
        }
        self.handle(Event::Tick);
    }

    pub(super) fn serve_io(&self, io: &mut IoLoop) {
        let IoLoop {
            poll,
            connections,
            serving,
        } = io;
        let mut events = mio::Events::with_capacity(256);
        loop {
            if let Err(e) = poll.poll(&mut events, None) {
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::error!(gpu = %self.gpu, error = %e, "token I/O poll failed");
                    std::thread::sleep(Duration::from_millis(10));
                }
                continue;
            }
            for event in events.iter() {
                if event.token() == WAKE {
                    for arriving in self.io.take() {
                        let fd = arriving.connection.fd();
                        let token = mio::Token(arriving.client as usize);
                        let registered = poll.registry().register(
                            &mut mio::unix::SourceFd(&fd),
                            token,
                            mio::Interest::READABLE,
                        );
                        match registered {
                            // Registering a socket that is already readable reports
                            // it, so a request sent before this moment is not lost.
                            Ok(()) => {
                                connections.insert(arriving.client, arriving.connection);
                            }
                            Err(e) => {
                                tracing::warn!(gpu = %self.gpu, error = %e, "cannot watch a token connection");
                                self.leave(arriving.client, None);
                            }
                        }
                    }
                    continue;
                }
                let client = event.token().0 as ClientId;
                let Some(connection) = connections.get_mut(&client) else {
                    continue;
                };
                *serving = Some(client);
                let pumped = connection.pump(|request| {
                    let event = match request {
                        TokenRequest::Want => Event::Want { client },
                        TokenRequest::Release { again } => Event::Release { client, again },
                        TokenRequest::Fit { need_ns, counts } => {
                            self.record_fit(client, counts);
                            Event::Need { client, need_ns }
                        }
                    };
                    self.handle(event);
                });
                if let Err(e) = pumped {
                    if let Some(connection) = connections.remove(&client) {
                        let fd = connection.fd();
                        let _ = poll.registry().deregister(&mut mio::unix::SourceFd(&fd));
                    }
                    self.leave(client, Some(e));
                }
                *serving = None;
            }
        }
    }

    /// EOF, a protocol error, or the arbiter closed it: the token is lost at once.
    pub(super) fn leave(&self, client: ClientId, why: Option<TokenError>) {
        self.handle(Event::Leave { client });
        let gone = {
            let mut state = self.lock();
            // A client that goes while holding loses the token now: its hold ends.
            state.end_hold(client, monotonic_ns());
            let gone = state.clients.remove(&client);
            if let Some(r) = &gone {
                if let Some(a) = state.accounts.get_mut(&r.account) {
                    a.clients = a.clients.saturating_sub(1);
                }
            }
            gone
        };
        if let Some(r) = gone {
            match why {
                None | Some(TokenError::Frame(FrameError::Closed)) => {
                    tracing::info!(gpu = %self.gpu, lease = %r.lease, pid = ?r.pid, "token client left")
                }
                Some(e) => {
                    tracing::info!(gpu = %self.gpu, lease = %r.lease, pid = ?r.pid, error = %e, "token client dropped")
                }
            }
        }
    }
}
