//! The shared page of one token client: a memfd mapped writable here, sealed so the
//! client can map it only read-only.

use super::*;

/// The arbiter's writable mapping of one client's page.
pub(super) struct PageMapping {
    pub(super) page: NonNull<TokenPage>,
    /// The client's clock: every instant goes onto the page in it.
    pub(super) clock: ClockOffset,
}

// SAFETY: the mapping is only accessed through the page's atomics.
unsafe impl Send for PageMapping {}
// SAFETY: as above.
unsafe impl Sync for PageMapping {}

impl PageMapping {
    /// A fresh memfd holding an initialised page, mapped writable here and sealed
    /// so that nobody else can ever map it writable or change its size.
    pub(super) fn create(clock: ClockOffset) -> Result<(PageMapping, OwnedFd), TokenError> {
        use nix::fcntl::{fcntl, FcntlArg, SealFlag};
        use nix::sys::memfd::{memfd_create, MFdFlags};
        use nix::sys::mman::{mmap, MapFlags, ProtFlags};
        let err = |step| move |source| TokenError::Page { step, source };
        let fd = memfd_create(
            c"gpushare-token",
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
        )
        .map_err(err("memfd_create"))?;
        nix::unistd::ftruncate(&fd, TOKEN_PAGE_SIZE as i64).map_err(err("ftruncate"))?;
        let length = NonZeroUsize::new(TOKEN_PAGE_SIZE).expect("non-zero");
        // SAFETY: a new shared mapping of a memfd we own, at a kernel-chosen address.
        let address = unsafe {
            mmap(
                None,
                length,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                &fd,
                0,
            )
        }
        .map_err(err("mmap"))?;
        let page = address.cast::<TokenPage>();
        // SAFETY: the mapping is TOKEN_PAGE_SIZE bytes, page-aligned (≥ TokenPage's
        // 64-byte alignment), and nobody else can see it yet.
        unsafe { page.as_ptr().write(TokenPage::new()) };
        let mapping = PageMapping { page, clock };
        // FUTURE_WRITE (Linux 5.1) forbids new writable mappings and write(2), while
        // ours stays writable: the client can then only map the page read-only.
        let sealed = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
        match fcntl(
            &fd,
            FcntlArg::F_ADD_SEALS(sealed | SealFlag::F_SEAL_FUTURE_WRITE),
        ) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINVAL) => {
                tracing::debug!("F_SEAL_FUTURE_WRITE unsupported; sealing the size only");
                fcntl(&fd, FcntlArg::F_ADD_SEALS(sealed)).map_err(err("F_ADD_SEALS"))?;
            }
            Err(e) => return Err(err("F_ADD_SEALS")(e)),
        }
        Ok((mapping, fd))
    }

    pub(super) fn page(&self) -> &TokenPage {
        // SAFETY: mapped for as long as `self` lives.
        unsafe { self.page.as_ref() }
    }

    /// Publishes a change: everything stored before is visible to a client that sees
    /// the new `seq` (Release), and a client blocked on `seq` wakes (by the caller,
    /// after it dropped its lock).
    pub(super) fn bump(&self) {
        self.page().seq.fetch_add(1, Ordering::Release);
    }

    /// Changes the page for `action` and returns true, or false when the action only
    /// reports something (the page stays as it is: nothing to publish).
    pub(super) fn apply(&self, action: &Action) -> bool {
        let page = self.page();
        match *action {
            Action::Grant {
                deadline_ns,
                launch_ahead,
                ..
            } => {
                // Order per token.rs: limits, then the deadline, then seq.
                page.launch_ahead.store(launch_ahead, Ordering::Relaxed);
                page.deadline_ns
                    .store(self.clock.to_client(deadline_ns), Ordering::Release);
                page.grants.fetch_add(1, Ordering::Release);
            }
            Action::Revoke { .. } => page.deadline_ns.store(NOT_HELD, Ordering::Release),
            Action::SetLaunchAhead { n, .. } => page.launch_ahead.store(n, Ordering::Release),
            Action::SetFitBy { fit_by_ns, .. } => page
                .fit_by_ns
                .store(self.clock.to_client(fit_by_ns), Ordering::Release),
            Action::Overdue { .. } | Action::Overrun { .. } | Action::Recovered { .. } => {
                return false
            }
        }
        self.bump();
        true
    }

    /// The lease ended: the client must stop for good (the only cut-off there is).
    pub(super) fn cut_off(&self) {
        let page = self.page();
        page.flags.fetch_or(FLAG_CUT_OFF, Ordering::Relaxed);
        page.deadline_ns.store(NOT_HELD, Ordering::Release);
    }
}

impl Drop for PageMapping {
    fn drop(&mut self) {
        // SAFETY: mapped by `create`, unmapped once, here.
        let _ = unsafe { nix::sys::mman::munmap(self.page.cast(), TOKEN_PAGE_SIZE) };
    }
}
