//! Steps that resolve driver entry points: `cuGetProcAddress` (and the resolvers it
//! answers), `dlsym` on the driver's handle, `RTLD_NEXT`.

use crate::{fatal, num, who, GetProc, Held, Probe, Ptr, R};
use std::ffi::{c_int, c_void, CString};

/// Resolves `cuMemAlloc` through `get` (a `cuGetProcAddress_v2`-shaped resolver) and
/// allocates `bytes` with the answer; returns its result and the function it called.
fn alloc_through(p: &mut Probe, get: GetProc, version: c_int, bytes: usize) -> (R, *mut c_void) {
    let (mut f, mut status) = (std::ptr::null_mut(), 0);
    // SAFETY: a resolver with cuGetProcAddress_v2's signature, given a NUL-terminated name
    // and live locals for the pointer and the query result.
    let rc = unsafe { get(c"cuMemAlloc".as_ptr(), &mut f, version, 0, &mut status) };
    if rc != 0 || f.is_null() {
        fatal(&format!("resolving cuMemAlloc: {rc}"));
    }
    // SAFETY: `f` is non-null (checked above) and cuMemAlloc_v2's, of this type.
    let alloc: unsafe extern "C" fn(*mut Ptr, usize) -> R = unsafe { std::mem::transmute(f) };
    let mut ptr = 0;
    // SAFETY: cuMemAlloc_v2, given a live CUdeviceptr to write.
    let rc = unsafe { alloc(&mut ptr, bytes) };
    if rc == 0 {
        p.held.push(Held::Device(ptr));
    }
    (rc, f)
}

pub(crate) fn legacy_launch(p: &mut Probe) {
    // No simulated driver exports cuLaunch: the wrapper must say so, not crash.
    let c = &p.cuda;
    let (rc, ptr) = c.lookup("cuLaunch", 2000, 0);
    p.report("legacy-launch", rc, &format!("via={}", who(ptr)));
}

pub(crate) fn ptsz_procaddr_alloc(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    // What a per-thread-default-stream build does: cuda.h's cuGetProcAddress is
    // cuGetProcAddress_v2_ptsz there, asked with the default flags.
    let c = &p.cuda;
    let bytes = num(args) as usize;
    // SAFETY: a live handle and a NUL-terminated name.
    let sym = unsafe { libc::dlsym(c.handle, c"cuGetProcAddress_v2_ptsz".as_ptr()) };
    if sym.is_null() {
        fatal("no cuGetProcAddress_v2_ptsz");
    }
    // SAFETY: cuGetProcAddress_v2_ptsz has cuGetProcAddress_v2's signature.
    let get: GetProc = unsafe { std::mem::transmute::<*mut c_void, GetProc>(sym) };
    let (rc, f) = alloc_through(p, get, c.version, bytes);
    p.report(
        "ptsz-procaddr-alloc",
        rc,
        &format!("bytes={bytes} via={}", who(f)),
    );
}

pub(crate) fn resolver_alloc(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    // The resolver asked for through the resolver (with the given flags), then
    // cuMemAlloc through the answer: what a library handed cuGetProcAddress does.
    let c = &p.cuda;
    let flags = num(args);
    let bytes = num(args) as usize;
    let (rc, resolver) = c.lookup("cuGetProcAddress", c.version, flags);
    if rc != 0 || resolver.is_null() || c.version < 12000 {
        fatal(&format!(
            "cuGetProcAddress_v2(cuGetProcAddress, {flags}): {rc}"
        ));
    }
    // SAFETY: non-null (checked), and for CUDA 12.0+ the answer is cuGetProcAddress_v2.
    let get: GetProc = unsafe { std::mem::transmute::<*mut c_void, GetProc>(resolver) };
    let (rc, f) = alloc_through(p, get, c.version, bytes);
    p.report(
        "resolver-alloc",
        rc,
        &format!(
            "bytes={bytes} resolver_via={} via={}",
            who(resolver),
            who(f)
        ),
    );
}

pub(crate) fn procaddr(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    let c = &p.cuda;
    let name = args
        .next()
        .unwrap_or_else(|| fatal("procaddr NAME VERSION FLAGS"));
    let (version, flags) = (num(args) as c_int, num(args));
    let (rc, ptr) = c.lookup(&name, version, flags);
    p.report(
        "procaddr",
        rc,
        &format!(
            "name={name} version={version} flags={flags} via={}",
            who(ptr)
        ),
    );
}

pub(crate) fn dlsym(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    let c = &p.cuda;
    let name = args.next().unwrap_or_else(|| fatal("dlsym NAME"));
    let cname = CString::new(name.clone()).unwrap();
    // SAFETY: a live handle and a NUL-terminated name.
    let ptr = unsafe { libc::dlsym(c.handle, cname.as_ptr()) };
    p.report("dlsym", 0, &format!("name={name} via={}", who(ptr)));
}

pub(crate) fn next(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    // dlsym(RTLD_NEXT) searches after the *calling* object: from this program,
    // the preloaded library comes next.
    let name = args.next().unwrap_or_else(|| fatal("next NAME"));
    let cname = CString::new(name.clone()).unwrap();
    // SAFETY: a pseudo-handle and a NUL-terminated name.
    let ptr = unsafe { libc::dlsym(libc::RTLD_NEXT, cname.as_ptr()) };
    p.report("next", 0, &format!("name={name} via={}", who(ptr)));
}
