//! The resolver never escapes: whatever way a program reaches `cuGetProcAddress`, what it
//! resolves afterwards leads through the wrappers (charged, gated).

mod common;

use common::*;

/// A per-thread-default-stream request for the resolver itself (flags
/// CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) is answered by the driver with its plain
/// `cuGetProcAddress_v2`; that answer is wrapped too, so an allocation resolved through it
/// is charged and refused over the quota. For both flags the same holds.
#[test]
fn the_resolver_asked_for_through_the_resolver_is_wrapped_for_every_flag() {
    let mut m = Machine::start();
    for flags in ["0", "1", "2"] {
        let lease = m.lease("1Gi");
        let s = run(&mut m.probe(
            Some(&lease),
            &[
                "resolver-alloc",
                flags,
                "600Mi",
                "resolver-alloc",
                flags,
                "600Mi",
            ],
        ));
        let resolver = s.value("resolver-alloc", 0, "resolver_via");
        assert!(
            resolver.starts_with("libgpushare"),
            "flags {flags}: the driver's resolver escaped: {resolver}"
        );
        assert_eq!(
            s.result("resolver-alloc", 0),
            "CUDA_SUCCESS",
            "flags {flags}: {}",
            s.stderr
        );
        assert_eq!(
            s.result("resolver-alloc", 1),
            "CUDA_ERROR_OUT_OF_MEMORY",
            "flags {flags}: uncharged, the allocation went around the quota: {:?}",
            s.lines
        );
    }
}
