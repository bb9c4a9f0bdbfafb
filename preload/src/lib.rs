//! libgpushare.so — the CUDA driver interposer loaded into every sharing container.
//!
//! The container runtime preloads it (`LD_PRELOAD`); with `GPUSHARE_LEASE` in the
//! environment, or the lease's socket mounted where the runtime puts it, it takes over
//! the process's view of the driver:
//!
//! What it does:
//!
//! - **Interposition**: the CUDA runtime does not call `cu*` by name. It `dlopen`s
//!   `libcuda.so.1`, takes `cuGetProcAddress_v2` with `dlsym`, and asks it for every
//!   other entry point by (name, CUDA version, flags). So `dlsym` and
//!   `cuGetProcAddress`/`_v2` hand out our wrappers, chosen for the exact variant (ABI)
//!   the request selects, and the `cu*` names are exported too for programs that link
//!   `libcuda` directly.
//! - **Memory**: every device allocation path is charged to the container's ledger in
//!   the arbiter before it happens, and credited after it is freed; over quota the call
//!   answers `CUDA_ERROR_OUT_OF_MEMORY` with nothing allocated.
//! - **Virtualised answers** ([`hooks::info`]): `cuMemGetInfo_v2`,
//!   `cuDeviceTotalMem_v2` and NVML's memory info report the quota.
//! - **Launch gate** ([`gate`]): every launch entry point passes one gate, the
//!   time-slice token: an atomic load of the arbiter's shared page and a clock read
//!   while holding it; a per-process agent thread asks, returns and reconnects.
//!
//! The layers, bottom to top; each module uses only the ones below it (and those before
//! it in its own layer), which `tests/layering.rs` checks:
//!
//! 1. **ABI types and ground**: [`cuda`] (the driver's types and constants), [`log`],
//!    [`guard`] (no panic crosses the C ABI), [`config`] (the environment, read once),
//!    [`variants`] (the one declaration of every wrapped variant).
//! 2. **Dynamic loading** ([`loader`]): glibc's own `dlsym`, the driver's definitions.
//! 3. **Real-pointer slots** ([`symbols`]): per variant, the driver function its
//!    wrapper forwards to.
//! 4. **Driver calls** ([`driver`]): entry points the library calls for itself.
//! 5. **Accounts and gate**: [`gate`] (the launch gate), [`watch`] (re-attach after an
//!    arbiter restart), [`lease_link`] (the connection to the lease's ledger in the arbiter), [`accounts`] (what
//!    each allocation was charged, over the `Ledger` and `DeviceMemory` traits),
//!    [`graph_memory`] (what executable graphs' memory nodes need, charged before their
//!    launch), [`fork`] (the fork child's reset).
//! 6. **Exported hooks** ([`hooks`]): one wrapper per variant.
//! 7. **The front door** ([`front`]): `dlsym` and `cuGetProcAddress`, which hand the
//!    wrappers out.
//!
//! Without either the library is inert: the exports forward, `dlsym` and
//! `cuGetProcAddress` hand out the driver's own pointers.

pub mod accounts;
pub mod config;
pub mod cuda;
pub mod driver;
pub mod fork;
pub mod front;
pub mod gate;
pub mod graph_memory;
pub mod guard;
pub mod hooks;
pub mod lease_link;
pub mod loader;
pub mod log;
pub mod symbols;
pub mod variants;
pub mod watch;

/// Runs once when the library is loaded, before the program's `main`: reads the
/// environment (the only place it is read) and, when a lease is present, arms the
/// interposer. No I/O here: the arbiter is reached lazily, at the first allocation or
/// memory query, so loading the library into a process that never uses CUDA costs
/// nothing.
extern "C" fn on_load() {
    guard::quietly(|| {
        // Find glibc's dlsym now: where the GLIBC_2.34 version is missing (glibc < 2.34)
        // the failed lookup allocates its error message, which must not happen inside
        // a later dlsym call (a malloc replacement's own lookups would re-enter it).
        loader::resolve_real_dlsym();
        let settings = config::Settings::from_environment();
        log::set_level(settings.log);
        if config::install(settings) {
            fork::install_handlers();
            gate::on_cold_admit(accounts::attach_after_context_creation);
            crate::log_info!(
                "active for lease {}",
                config::get().map_or("?", |c| c.lease.as_str())
            );
        }
    });
}

// SAFETY: a constructor in `.init_array` is called by the dynamic loader with no
// arguments, once, after the library's dependencies are initialised.
#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = on_load;
