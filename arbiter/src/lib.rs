//! gpushare-arbiter: the node daemon that owns every lease and every decision.
//!
//! Decisions (placement, the lease table) are plain functions and structs that
//! unit tests drive directly; sockets and files sit at the edges (`server`, `store`).

pub mod inventory;
pub mod placement;
pub mod server;
pub mod state;
pub mod store;
