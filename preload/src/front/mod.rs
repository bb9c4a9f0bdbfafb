//! The front door, the top layer: what a process's lookups reach. `dlsym` and
//! `cuGetProcAddress`/`_v2` forward to the driver and, for a variant we wrap, record
//! the driver's pointer in its slot (`symbols`) and hand out our wrapper (`hooks`).
//! The wrapper of each variant comes from the one declaration in `variants`.

pub mod dlsym;
pub mod procaddr;

use libc::c_void;

use crate::hooks::{copy, info, launch, memory, work};
use crate::symbols::{self, Hook};

macro_rules! define_wrappers {
    ($( $name:ident : $library:ident $proc_address:tt => $wrapper:path ),* $(,)?) => {
        /// Address of `hook`'s exported wrapper.
        pub fn wrapper(hook: Hook) -> *mut c_void {
            match hook { $(Hook::$name => $wrapper as *const () as *mut c_void),* }
        }
    };
}

crate::for_each_variant!(define_wrappers);

/// Records the driver's function for `hook`, unless it is our own wrapper (a lookup
/// through `RTLD_DEFAULT` or our own handle finds the wrapper first: storing it would
/// make the wrapper call itself).
#[inline]
fn record_real(hook: Hook, real: *mut c_void) {
    if real != wrapper(hook) {
        symbols::record_real(hook, real);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrappers_are_distinct() {
        let mut seen = std::collections::HashSet::new();
        for &h in Hook::ALL {
            assert!(seen.insert(wrapper(h)), "{h:?} shares a wrapper");
        }
    }

    #[test]
    fn own_wrapper_is_never_recorded_as_real() {
        // A slot no other unit test fills.
        record_real(
            Hook::cuMemExportToShareableHandle,
            wrapper(Hook::cuMemExportToShareableHandle),
        );
        assert_eq!(
            symbols::real_if_known(Hook::cuMemExportToShareableHandle),
            None
        );
    }
}
