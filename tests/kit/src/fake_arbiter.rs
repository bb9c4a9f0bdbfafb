//! A stand-in for the arbiter's token side, for the interposer's gate tests and its
//! benchmark (it lived in libgpushare.so before; no test code ships in the library):
//! answers `Hello` and `Schedule` on a Unix socket with a real memfd page passed by
//! `SCM_RIGHTS`, records the `TokenRequest`s it receives, and lets the test grant,
//! revoke, cut off and hang up. Not used by the library itself.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpushare_proto::frame::{self, read_message, write_message};
use gpushare_proto::token::{FLAG_CUT_OFF, NOT_HELD, TOKEN_PAGE_SIZE};
use gpushare_proto::token_client::futex_wake;
use gpushare_proto::{
    ErrorKind, LeaseRequest, LeaseResponse, ScheduleTerms, TokenPage, TokenRequest,
};

/// How the stand-in answers `Schedule`.
#[derive(Debug, Clone)]
pub enum Answer {
    Schedule(ScheduleTerms),
    Refuse,
}

#[derive(Debug)]
struct Current {
    page: &'static TokenPage,
    stream: UnixStream,
}

#[derive(Debug)]
pub struct FakeArbiter {
    socket: PathBuf,
    current: Arc<Mutex<Option<Current>>>,
    requests: Receiver<TokenRequest>,
    answer: Arc<Mutex<Answer>>,
    connections: Arc<Mutex<usize>>,
}

impl FakeArbiter {
    /// Listens on `socket`; each new page starts with `initial_deadline_ns`.
    pub fn start(socket: &Path, answer: Answer, initial_deadline_ns: u64) -> FakeArbiter {
        let listener = UnixListener::bind(socket).expect("bind the stand-in's socket");
        let current = Arc::new(Mutex::new(None));
        let answer = Arc::new(Mutex::new(answer));
        let connections = Arc::new(Mutex::new(0));
        let (sender, requests) = channel();
        {
            let (current, answer, connections) =
                (current.clone(), answer.clone(), connections.clone());
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    let Ok(stream) = stream else { return };
                    *connections.lock().unwrap() += 1;
                    let answer = answer.lock().unwrap().clone();
                    let (current, sender) = (current.clone(), sender.clone());
                    std::thread::spawn(move || {
                        serve(stream, answer, initial_deadline_ns, current, sender)
                    });
                }
            });
        }
        FakeArbiter {
            socket: socket.to_path_buf(),
            current,
            requests,
            answer,
            connections,
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        *self.connections.lock().unwrap()
    }

    pub fn set_answer(&self, answer: Answer) {
        *self.answer.lock().unwrap() = answer;
    }

    /// The next request received, if one comes within `timeout`.
    pub fn next_request(&self, timeout: Duration) -> Option<TokenRequest> {
        self.requests.recv_timeout(timeout).ok()
    }

    /// Waits until a client is scheduled (its page exists).
    pub fn wait_scheduled(&self, timeout: Duration) -> bool {
        let until = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < until {
            if self.current.lock().unwrap().is_some() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }

    fn with_page(&self, change: impl FnOnce(&TokenPage)) {
        let guard = self.current.lock().unwrap();
        let page = guard.as_ref().expect("a scheduled client").page;
        change(page);
        page.seq.fetch_add(1, Ordering::Release);
        futex_wake(&page.seq);
    }

    /// Grants the token until `deadline_ns` with a launch-ahead bound.
    pub fn grant(&self, deadline_ns: u64, launch_ahead: u32) {
        self.with_page(|page| {
            page.launch_ahead.store(launch_ahead, Ordering::Release);
            page.deadline_ns.store(deadline_ns, Ordering::Release);
            page.grants.fetch_add(1, Ordering::Release);
        });
    }

    pub fn revoke(&self) {
        self.with_page(|page| page.deadline_ns.store(NOT_HELD, Ordering::Release));
    }

    /// Marks the page cut off and hangs up, as the arbiter does to the clients of a
    /// lease that ended.
    pub fn cut_off(&self) {
        self.with_page(|page| {
            page.flags.fetch_or(FLAG_CUT_OFF, Ordering::Release);
            page.deadline_ns.store(NOT_HELD, Ordering::Release);
        });
        self.hang_up();
    }

    /// Closes the current connection (an arbiter that exited).
    pub fn hang_up(&self) {
        if let Some(current) = self.current.lock().unwrap().take() {
            let _ = current.stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn serve(
    mut stream: UnixStream,
    answer: Answer,
    initial_deadline_ns: u64,
    current: Arc<Mutex<Option<Current>>>,
    requests: Sender<TokenRequest>,
) {
    let Ok(LeaseRequest::Hello { protocol }) = read_message(&mut stream) else {
        return;
    };
    if write_message(&mut stream, &LeaseResponse::Hello { protocol }).is_err() {
        return;
    }
    let Ok(LeaseRequest::Schedule) = read_message(&mut stream) else {
        return;
    };
    let terms = match answer {
        Answer::Refuse => {
            let _ = write_message(
                &mut stream,
                &LeaseResponse::Error {
                    kind: ErrorKind::PermissionDenied,
                    message: "scheduling is off".into(),
                },
            );
            return;
        }
        Answer::Schedule(terms) => terms,
    };
    let (fd, page) = new_page().expect("a memfd page");
    page.deadline_ns
        .store(initial_deadline_ns, Ordering::Release);
    let body = frame::encode(&LeaseResponse::Scheduled(terms)).expect("encode");
    send_with_fd(&stream, &body, &fd).expect("send the page");
    drop(fd);
    *current.lock().unwrap() = Some(Current {
        page,
        stream: stream.try_clone().expect("clone"),
    });
    while let Ok(request) = read_message::<TokenRequest>(&mut stream) {
        if requests.send(request).is_err() {
            return;
        }
    }
}

/// A fresh page in a memfd, mapped writable here (leaked: tests are short).
fn new_page() -> io::Result<(OwnedFd, &'static TokenPage)> {
    // SAFETY: a NUL-terminated name; the descriptor is owned from here.
    let fd = unsafe { libc::memfd_create(c"gpushare-token".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor memfd_create just returned.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sizing our own memfd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), TOKEN_PAGE_SIZE as libc::off_t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a shared writable mapping of our memfd, address chosen by the kernel.
    let address = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            TOKEN_PAGE_SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if address == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let page = address as *mut TokenPage;
    // SAFETY: a fresh, aligned, writable mapping large enough for the page.
    unsafe { page.write(TokenPage::new()) };
    // SAFETY: initialised above, never unmapped.
    Ok((fd, unsafe { &*page }))
}

/// Sends one frame with `fd` attached to its first byte.
fn send_with_fd(stream: &UnixStream, body: &[u8], fd: &OwnedFd) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: body.as_ptr() as *mut libc::c_void,
        iov_len: body.len(),
    };
    let mut control = [0u64; 8];
    // SAFETY: msghdr is plain data; zeroed is a valid empty header.
    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
    header.msg_iov = &mut iov;
    header.msg_iovlen = 1;
    header.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is a size computation.
    header.msg_controllen = unsafe { libc::CMSG_SPACE(std::mem::size_of::<i32>() as u32) } as _;
    // SAFETY: the control buffer holds one descriptor's message (CMSG_SPACE above);
    // the header points at live buffers of the sizes it states.
    let sent = unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&header);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<i32>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg) as *mut i32, fd.as_raw_fd());
        libc::sendmsg(stream.as_raw_fd(), &header, 0)
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    std::io::Write::write_all(&mut &*stream, &body[sent as usize..])
}
