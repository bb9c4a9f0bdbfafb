//! libgpushare.so — the CUDA driver interposer loaded into every sharing container.
//!
//! Today the library is inert: it loads into any process (so the wrapper's
//! `LD_PRELOAD` and bind mount are exercised end to end) and changes nothing.
//! Interception, memory quotas and the time-slice gate arrive with their issues;
//! the design is in ../shared/DESIGN.md, "The preload library".
