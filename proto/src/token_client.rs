//! The client side of a token connection, shared by the interposer, the tests and the
//! benchmarks: open it (receiving and mapping the page), send `Want`/`Release`, and wait
//! for the page to change. Blocking, no async runtime; nothing here allocates after
//! `open`.
//!
//! The page and the futex calls are the one place this crate touches raw memory shared
//! with another process, hence the `unsafe` blocks (each with its `SAFETY:`).

use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::frame::{self, FrameError};
use crate::lease_socket::{LeaseRequest, LeaseResponse};
use crate::message::ErrorKind;
use crate::token::{ScheduleTerms, TokenPage, TokenRequest, TOKEN_PAGE_MAGIC, TOKEN_PAGE_SIZE};
use crate::PROTOCOL_VERSION;

#[derive(Debug, thiserror::Error)]
pub enum TokenClientError {
    #[error("token connection: {0}")]
    Io(#[from] io::Error),
    #[error("token connection: {0}")]
    Frame(#[from] FrameError),
    #[error("the arbiter refused to schedule ({kind:?}): {message}")]
    Refused { kind: ErrorKind, message: String },
    #[error("the arbiter speaks protocol {0}, this client {PROTOCOL_VERSION}")]
    Version(u32),
    #[error("unexpected answer from the arbiter: {0}")]
    Unexpected(String),
    #[error("the Scheduled answer came without a token page")]
    NoPage,
    #[error("the token page is not initialised (magic {0:#x})")]
    BadPage(u32),
}

/// An open token connection and its read-only mapping of the page.
#[derive(Debug)]
pub struct TokenConnection {
    stream: UnixStream,
    page: *const TokenPage,
    terms: ScheduleTerms,
}

// SAFETY: the page is only read through atomics, and the mapping lives as long as the
// connection; the stream is Send + Sync.
unsafe impl Send for TokenConnection {}
// SAFETY: as above.
unsafe impl Sync for TokenConnection {}

impl TokenConnection {
    /// Connects to a lease socket, greets, asks to be scheduled and maps the page.
    /// `timeout` bounds each read and write of the opening.
    pub fn open(socket: &Path, timeout: Duration) -> Result<TokenConnection, TokenClientError> {
        let mut stream = UnixStream::connect(socket)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        frame::write_message(
            &mut stream,
            &LeaseRequest::Hello {
                protocol: PROTOCOL_VERSION,
            },
        )?;
        match frame::read_message(&mut stream)? {
            LeaseResponse::Hello { protocol } if protocol == PROTOCOL_VERSION => {}
            LeaseResponse::Hello { protocol } => return Err(TokenClientError::Version(protocol)),
            LeaseResponse::Error { kind, message } => {
                return Err(TokenClientError::Refused { kind, message })
            }
            other => return Err(TokenClientError::Unexpected(format!("{other:?}"))),
        }
        frame::write_message(&mut stream, &LeaseRequest::Schedule)?;
        let (response, fd) = read_frame_with_fd(&stream)?;
        let terms = match response {
            LeaseResponse::Scheduled(terms) => terms,
            LeaseResponse::Error { kind, message } => {
                return Err(TokenClientError::Refused { kind, message })
            }
            other => return Err(TokenClientError::Unexpected(format!("{other:?}"))),
        };
        let fd = fd.ok_or(TokenClientError::NoPage)?;
        let page = map_read_only(&fd)?;
        drop(fd); // the mapping keeps the memfd alive
                  // SAFETY: `page` is a live, aligned, TOKEN_PAGE_SIZE-byte mapping.
        let magic = unsafe { (*page).magic.load(Ordering::Acquire) };
        if magic != TOKEN_PAGE_MAGIC {
            unmap(page);
            return Err(TokenClientError::BadPage(magic));
        }
        // Requests are one-way; only a stuck arbiter would block a write, and then the
        // client should treat it as gone rather than hang a launch.
        stream.set_read_timeout(None)?;
        Ok(TokenConnection {
            stream,
            page,
            terms,
        })
    }

    pub fn terms(&self) -> &ScheduleTerms {
        &self.terms
    }

    pub fn page(&self) -> &TokenPage {
        // SAFETY: mapped for as long as `self` lives.
        unsafe { &*self.page }
    }

    /// The mapping's address, for a caller that publishes it to a hot path which
    /// outlives borrows (the interposer keeps the connection for the process's life or
    /// swaps the pointer away before dropping it).
    pub fn page_ptr(&self) -> *const TokenPage {
        self.page
    }

    /// The socket's descriptor (a fork child closes its inherited copy).
    pub fn raw_fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Sends one request. Encodes into a stack buffer: no allocation.
    pub fn send(&self, request: TokenRequest) -> Result<(), TokenClientError> {
        // The arbiter reads at most 256 bytes per token frame (`MAX_TOKEN_FRAME`); a
        // `fit` report with every count at u64::MAX is about 210. On the stack: no
        // allocation on the way to a release.
        let mut buffer = [0u8; 256];
        let body_len = {
            let mut cursor = io::Cursor::new(&mut buffer[4..]);
            serde_json::to_writer(&mut cursor, &request)
                .map_err(|e| TokenClientError::Unexpected(e.to_string()))?;
            cursor.position() as usize
        };
        buffer[..4].copy_from_slice(&(body_len as u32).to_be_bytes());
        (&self.stream).write_all(&buffer[..4 + body_len])?;
        Ok(())
    }

    /// Blocks until the page's `seq` differs from `seen` or `timeout` passes (a spurious
    /// early return is possible: callers re-read the page).
    pub fn wait_for_change(&self, seen: u32, timeout: Duration) {
        futex_wait(&self.page().seq, seen, timeout);
    }

    /// True once the arbiter's end of the connection is gone (it exited or cut this
    /// client off). Never blocks: the arbiter sends nothing after `Scheduled`, so any
    /// readable state is a hang-up.
    pub fn is_closed(&self) -> bool {
        let mut poll = libc::pollfd {
            fd: self.stream.as_raw_fd(),
            events: libc::POLLIN | libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout.
        let ready = unsafe { libc::poll(&mut poll, 1, 0) };
        ready > 0 && poll.revents != 0
    }
}

impl Drop for TokenConnection {
    fn drop(&mut self) {
        unmap(self.page);
    }
}

/// Waits on a futex word shared between processes (not `FUTEX_PRIVATE`).
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned u32 for the duration of the call; the timeout
    // is relative; the kernel only reads the word. Any return (woken, timeout, EAGAIN
    // because it already changed, EINTR) is fine: callers re-read.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

/// Wakes every process waiting on a shared futex word.
pub fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned u32; FUTEX_WAKE does not touch memory.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

/// Reads one frame, taking the descriptor passed with its first byte, if any.
fn read_frame_with_fd(
    stream: &UnixStream,
) -> Result<(LeaseResponse, Option<OwnedFd>), TokenClientError> {
    // Frames this small arrive whole in practice, but a stream socket promises nothing:
    // take what the first recvmsg brings (with the descriptor), then read the rest.
    let mut buffer = [0u8; 4096];
    let (mut filled, fd) = recv_with_fd(stream, &mut buffer)?;
    if filled == 0 {
        return Err(FrameError::Closed.into());
    }
    while filled < 4 {
        filled += read_some(stream, &mut buffer[filled..])?;
    }
    let body_len = u32::from_be_bytes(buffer[..4].try_into().expect("4 bytes")) as usize;
    if body_len + 4 > buffer.len() {
        return Err(TokenClientError::Unexpected(format!(
            "a {body_len}-byte answer to schedule"
        )));
    }
    while filled < 4 + body_len {
        filled += read_some(stream, &mut buffer[filled..4 + body_len])?;
    }
    let response = serde_json::from_slice(&buffer[4..4 + body_len])
        .map_err(|e| TokenClientError::Unexpected(e.to_string()))?;
    Ok((response, fd))
}

fn read_some(stream: &UnixStream, buffer: &mut [u8]) -> Result<usize, TokenClientError> {
    match std::io::Read::read(&mut &*stream, buffer)? {
        0 => Err(FrameError::Closed.into()),
        n => Ok(n),
    }
}

fn recv_with_fd(stream: &UnixStream, buffer: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buffer.as_mut_ptr().cast(),
        iov_len: buffer.len(),
    };
    // Room for one descriptor's control message, aligned as cmsghdr requires.
    let mut control = [0u64; 8];
    // SAFETY: msghdr is plain data; zeroed is a valid empty header.
    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
    header.msg_iov = &mut iov;
    header.msg_iovlen = 1;
    header.msg_control = control.as_mut_ptr().cast();
    header.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: header points at live buffers of the sizes it states; MSG_CMSG_CLOEXEC so a
    // descriptor received here never leaks into an exec'd child.
    let received =
        unsafe { libc::recvmsg(stream.as_raw_fd(), &mut header, libc::MSG_CMSG_CLOEXEC) };
    if received < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fd = None;
    // SAFETY: walking the control buffer recvmsg filled, with the libc macros that
    // bound every step by msg_controllen.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&header);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let raw = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg) as *const RawFd);
                // Only one descriptor is ever sent; a second one would be closed by its
                // OwnedFd being replaced here.
                fd = Some(OwnedFd::from_raw_fd(raw));
            }
            cmsg = libc::CMSG_NXTHDR(&header, cmsg);
        }
    }
    Ok((received as usize, fd))
}

fn map_read_only(fd: &OwnedFd) -> io::Result<*const TokenPage> {
    // SAFETY: a fresh shared read-only mapping of a descriptor we own; the kernel picks
    // the address. The arbiter sealed the memfd's size, so the page cannot shrink under
    // us (no SIGBUS).
    let address = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            TOKEN_PAGE_SIZE,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if address == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(address as *const TokenPage)
}

fn unmap(page: *const TokenPage) {
    // SAFETY: `page` came from map_read_only and is unmapped once (by its owner).
    unsafe { libc::munmap(page as *mut libc::c_void, TOKEN_PAGE_SIZE) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn a_futex_wait_returns_on_wake_and_on_timeout() {
        let word = Arc::new(AtomicU32::new(7));
        // Nobody wakes it: the timeout ends the wait.
        let began = Instant::now();
        futex_wait(&word, 7, Duration::from_millis(20));
        assert!(began.elapsed() >= Duration::from_millis(15));
        // A changed value returns at once (EAGAIN).
        let began = Instant::now();
        futex_wait(&word, 6, Duration::from_secs(5));
        assert!(began.elapsed() < Duration::from_secs(1));
        // A wake ends a long wait.
        let waker = {
            let word = word.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                word.store(8, Ordering::Release);
                futex_wake(&word);
            })
        };
        let began = Instant::now();
        while word.load(Ordering::Acquire) == 7 {
            futex_wait(&word, 7, Duration::from_secs(5));
        }
        assert!(began.elapsed() < Duration::from_secs(4));
        waker.join().unwrap();
    }

    #[test]
    fn requests_encode_as_frames_without_allocation_size_surprises() {
        // The stack buffer in `send` (and the arbiter's frame limit) must hold the
        // longest request: a fit report with every number at its largest.
        let most = u64::MAX;
        let longest = serde_json::to_vec(&TokenRequest::Fit {
            need_ns: most,
            counts: crate::FitCounts {
                fitted: most,
                unestimated: most,
                held_back: most,
                overran: most,
                overran_ns: most,
            },
        })
        .unwrap();
        assert!(longest.len() + 4 <= 256, "{} bytes", longest.len() + 4);
        let release = serde_json::to_vec(&TokenRequest::Release { again: false }).unwrap();
        assert!(release.len() < longest.len());
    }
}
