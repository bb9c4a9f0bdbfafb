//! The token clock, as the arbiter, the interposer and the simulated driver read it: tests
//! compare their own timestamps with token deadlines and launch times on this clock.

pub use gpushare_types::monotonic_ns;
